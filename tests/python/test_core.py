"""The connector core (kvlink.core) the three connectors share: its settings schema read from
an engine's place under the engine's names, the environment after it, the address policy,
the engine it builds, the metrics endpoint, the transfer parameters' checks."""

import os
import sys
import urllib.request

import pytest

import kvlink
from kvlink import core

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ports import free_port  # noqa: E402

KEY = b"a-deployment-key-of-32-bytes-000"


def test_settings_under_an_engines_names_then_the_environment():
    names = {"listen": "kvlink_host", "transport": "kvlink_transport", "lease": "kvlink_lease"}
    place = {"kvlink_host": "10.0.0.5", "kvlink_transport": "tcp", "lease": 3}
    env = {"KVLINK_LEASE": "9", "KVLINK_ABORT_TIMEOUT": "11", "KVLINK_AUTH_KEY": "from-the-env-not-read-here"}
    s = core.Settings.read(place, names, "kv_transfer_config", env)
    # "lease" is not the engine's name for it: the environment's value is taken.
    assert (s.host, s.port, s.transport, s.lease, s.abort_timeout) == ("10.0.0.5", 0, "tcp", 9.0, 11.0)
    # The key's variables are the engine's to read, as it reads them for every connector.
    assert s.auth_key is None
    assert s.engine_options() == {"transport": "tcp", "lease": 9.0, "abort_timeout": 11.0}
    # A field named None is not read from the place.
    assert core.Settings.read({"transport": "tcp"}, {"transport": None}, "x", {}).transport is None


@pytest.mark.parametrize(
    "listen, host, port",
    [("10.0.0.5:17000", "10.0.0.5", 17000), ("[fe80::1]:17000", "fe80::1", 17000), ("fe80::1", "fe80::1", 0),
     ("node-3", "node-3", 0), (":17000", None, 17000)],
)
def test_listen_forms(listen, host, port):
    s = core.Settings.read({"listen": listen}, env={})
    assert (s.host, s.port) == (host, port)


@pytest.mark.parametrize(
    "place, error",
    [({"listen": "h:port"}, "listen in here must be 'host:port'"),
     ({"listen": "h:70000"}, "listen in here must be 'host:port'"),
     ({"transport": "ib"}, "transport in here must be one of auto"),
     ({"request_timeout": "soon"}, "request_timeout in here must be a number of seconds"),
     ({"session_idle": -1}, "session_idle in here must be 0 or more seconds"),
     ({"metrics_port": 0}, None),
     ({"metrics_port": "http"}, "metrics_port in here must be a port"),
     ({"auth_key_file": "/nonexistent/key"}, "auth_key_file in here: cannot read")],
)
def test_bad_values_are_refused_naming_the_key(place, error):
    if error is None:  # 0 is unset for a port, as for listen's
        assert core.Settings.read(place, where="here", env={}).metrics_port == 0
        return
    with pytest.raises(ValueError, match=error):
        core.Settings.read(place, where="here", env={})


def test_a_key_file_loses_its_line_end_only(tmp_path):
    (tmp_path / "k").write_bytes(b" " + KEY + b"\r\n")
    assert core.Settings.read({"auth_key_file": str(tmp_path / "k")}, env={}).auth_key == b" " + KEY
    assert core.Settings.read({"auth_key": KEY.decode(), "auth_key_file": "/x"}, env={}).auth_key == KEY


def test_address_policy_for_ranks(monkeypatch):
    monkeypatch.delenv("KVLINK_AUTH_KEY", raising=False)
    monkeypatch.delenv("KVLINK_AUTH_KEY_FILE", raising=False)
    node = lambda: "10.9.8.7"  # noqa: E731
    unkeyed = core.Settings(port=17000)
    assert core.listen_address(unkeyed, 3, node) == "127.0.0.1:17003"
    assert core.listen_address(core.Settings(), 3, node) == "127.0.0.1:0"
    keyed = core.Settings(auth_key=KEY)
    assert core.listen_address(keyed, 0, node) == "10.9.8.7:0"
    assert core.advertised_host(core.Settings(host="fe80::1"), node) == "fe80::1"
    assert core.listen_address(core.Settings(host="fe80::1", port=9000), 1, node) == "[fe80::1]:9001"
    assert core.keyed(core.Settings(), {"KVLINK_AUTH_KEY_FILE": "/k"})


def test_make_engine_takes_the_settings_and_the_glues_options():
    s = core.Settings(transport="tcp", request_timeout=5.0, session_idle=0.0)
    e = core.make_engine(s, "127.0.0.1:0", tp_rank=1, tp_size=2)
    try:
        assert e.handshake_address.startswith("127.0.0.1:")
        assert "TCP" in core.transport_summary(e) and kvlink.transport_summary is core.transport_summary
    finally:
        e.close()
    with pytest.raises(kvlink.InvalidArgument, match="request_timeout"):
        core.make_engine(core.Settings(request_timeout=0.0), "127.0.0.1:0")


def test_metrics_served_on_the_ranks_port_when_asked():
    e = core.make_engine(core.Settings(), "127.0.0.1:0")
    try:
        assert core.serve_metrics(core.Settings(), [e], 0) is None
        base = free_port()
        server = core.serve_metrics(core.Settings(metrics_port=base - 1), [e], 1)
        assert server is not None and server.server_address == ("127.0.0.1", base)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{base}/metrics", timeout=10) as r:
                body = r.read().decode()
            assert "kvlink_reads_done_total" in body and e.engine_id in body
        finally:
            server.shutdown()
    finally:
        e.close()


def test_transfer_parameter_checks():
    assert core.block_ids([0, 7, (1 << 32) - 1]) == [0, 7, (1 << 32) - 1]
    assert core.block_ids((1, 2)) == [1, 2]
    for bad in ([1 << 32], [-1], [True], ["1"], "12", None):
        assert core.block_ids(bad) is None
    assert core.hold_token(5) == 5
    for bad in (0, 1 << 64, True, "5", None):
        assert core.hold_token(bad) is None
