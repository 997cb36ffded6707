"""Tests of the soak's traffic bookkeeping (blocks taken and given back, flights ended when a
worker dies) with fake workers: no process is started."""

import random
import unittest

from checks import Ledger
from traffic import Traffic


class FakeWorker:
    def __init__(self, name):
        self.name, self.life, self.addr, self.engine = name, 1, "127.0.0.1:1", f"{name}.1"
        self.stopped = False
        self.killed = False
        self.sent = []

    def alive(self):
        return True

    def send(self, **cmd):
        self.sent.append(cmd)
        return True


class FakeSoak:
    class o:
        blocks = 32
        concurrency = 2

    def __init__(self):
        self.rng = random.Random(1)
        self.ledger = Ledger(10.0, 3.0, 0.5)
        self.prefills, self.decodes = [FakeWorker("P1")], [FakeWorker("D1")]
        self.by_name = {"P1": self.prefills[0], "D1": self.decodes[0]}
        self.block_bytes = 10

    def now(self):
        return 1.0


class Flights(unittest.TestCase):
    def test_a_request_holds_then_reads_then_gives_its_blocks_back(self):
        s = FakeSoak()
        t = Traffic(s)
        t.issue()
        p, d = s.prefills[0], s.decodes[0]
        self.assertEqual([c["op"] for c in p.sent], ["hold", "hold"])
        self.assertEqual(t.in_flight(d), 2)
        rid = p.sent[0]["id"]
        t.event(1.1, "P1", 1, {"ev": "held", "id": rid, "token": 5})
        (read,) = d.sent
        self.assertEqual((read["op"], read["hold"], read["remote"]), ("read", 5, p.sent[0]["blocks"]))
        nbytes = 10 * sum(len(g) for g in read["local"])
        t.event(1.2, "D1", 1, {"ev": "received", "id": rid, "bytes": nbytes, "verified": nbytes})
        t.event(1.2, "P1", 1, {"ev": "sent", "id": rid})
        self.assertEqual(t.in_flight(d), 1)
        self.assertNotIn(rid, t.flights)
        self.assertEqual(s.ledger.violations, [])
        free = sum(len(g) for g in t.pool(p).free)
        self.assertEqual(free, 64 - sum(len(g) for g in p.sent[1]["blocks"]))

    def test_a_prefill_that_dies_before_its_holds_began_frees_its_decodes(self):
        s = FakeSoak()
        t = Traffic(s)
        t.issue()
        t.worker_died(s.prefills[0])
        self.assertEqual(t.in_flight(s.decodes[0]), 0)
        self.assertEqual(s.ledger.open_requests(), [])
        self.assertEqual(sum(len(g) for g in t.pool(s.decodes[0]).free), 64)

    def test_events_of_a_killed_life_are_ignored(self):
        s = FakeSoak()
        t = Traffic(s)
        t.issue()
        p = s.prefills[0]
        p.killed = True  # killed, its last events still in the queue
        t.worker_died(p)
        t.event(1.1, "P1", 1, {"ev": "sent", "id": "r1"})
        p.killed, p.life = False, 2  # restarted
        t.event(1.1, "P1", 1, {"ev": "held", "id": "r2", "token": 5})
        self.assertEqual(s.decodes[0].sent, [])
        self.assertEqual(s.ledger.violations, [])


if __name__ == "__main__":
    unittest.main()
