/*
 * Transfers KV-cache blocks between two kvlink engines through the C ABI, verifies every byte,
 * and exercises the error paths (status codes and kvlink_last_error). Built and run by
 * tests/c_program.rs; prints "c transfer ok" and exits 0 on success.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */

#include "kvlink.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#define TENSORS 4
#define BLOCKS 64
#define BLOCK_BYTES 4096
#define TENSOR_BYTES ((uint64_t)BLOCKS * BLOCK_BYTES)
#define REGION_BYTES (TENSORS * TENSOR_BYTES)
#define NREAD 8
#define REQ "c-req-1"
#define DEADLINE_S 30.0

static void fail(int line, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "transfer.c:%d: ", line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    exit(1);
}

/* A call that must succeed. */
#define CHECK(call)                                                                         \
    do {                                                                                    \
        int rc_ = (call);                                                                   \
        if (rc_ != KVLINK_OK) {                                                             \
            fail(__LINE__, "%s returned %d: %s", #call, rc_, kvlink_last_error());          \
        }                                                                                   \
    } while (0)

/* A call that must fail with `code` and a last error containing `needle`. */
#define CHECK_FAILS(call, code, needle)                                                     \
    do {                                                                                    \
        int rc_ = (call);                                                                   \
        const char *msg_ = kvlink_last_error();                                             \
        if (rc_ != (code)) {                                                                \
            fail(__LINE__, "%s returned %d, expected %d (%s)", #call, rc_, (code), msg_);   \
        }                                                                                   \
        if (strstr(msg_, (needle)) == NULL) {                                               \
            fail(__LINE__, "%s: last error \"%s\" does not mention \"%s\"", #call, msg_,    \
                 (needle));                                                                 \
        }                                                                                   \
    } while (0)

#define EXPECT(cond)                                                                        \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fail(__LINE__, "expected %s (last error: %s)", #cond, kvlink_last_error());     \
        }                                                                                   \
    } while (0)

static uint8_t pattern(unsigned tensor, unsigned block, unsigned byte) {
    return (uint8_t)(tensor * 131u + block * 31u + byte * 7u + (byte >> 8) + 1u);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int contains(const kvlink_finished *f, int kind, const char *id) {
    size_t n = kvlink_finished_count(f, kind);
    for (size_t i = 0; i < n; i++) {
        const char *got = kvlink_finished_id(f, kind, i);
        EXPECT(got != NULL);
        if (strcmp(got, id) == 0) {
            return 1;
        }
    }
    return 0;
}

/* Fails the program if `f` reports `id` as failed. */
static void refuse_failure(const kvlink_finished *f, const char *id, const char *who) {
    size_t n = kvlink_finished_count(f, KVLINK_FAILED);
    for (size_t i = 0; i < n; i++) {
        if (strcmp(kvlink_finished_id(f, KVLINK_FAILED, i), id) == 0) {
            fail(__LINE__, "%s: request %s failed (expired %d): %s", who, id,
                 kvlink_finished_expired(f, i), kvlink_finished_reason(f, i));
        }
    }
}

/* Waits until `engine` reports `id` with `kind`; returns that finished set (caller frees). */
static kvlink_finished *wait_for(kvlink_engine *engine, int kind, const char *id,
                                 const char *who) {
    double deadline = now_s() + DEADLINE_S;
    while (now_s() < deadline) {
        kvlink_finished *f = NULL;
        CHECK(kvlink_engine_wait_finished(engine, 200, &f));
        EXPECT(f != NULL);
        refuse_failure(f, id, who);
        if (contains(f, kind, id)) {
            return f;
        }
        kvlink_finished_free(f);
    }
    fail(__LINE__, "%s: %s did not finish within %.0f s", who, id, DEADLINE_S);
    return NULL;
}

/* Waits for request `id` to fail on `engine` with cause `cause`. */
static void expect_failed(kvlink_engine *engine, const char *id, const char *cause) {
    double deadline = now_s() + DEADLINE_S;
    while (now_s() < deadline) {
        kvlink_finished *f = NULL;
        CHECK(kvlink_engine_wait_finished(engine, 200, &f));
        for (size_t i = 0; i < kvlink_finished_count(f, KVLINK_FAILED); i++) {
            if (strcmp(kvlink_finished_id(f, KVLINK_FAILED, i), id) == 0) {
                if (strcmp(kvlink_finished_cause(f, i), cause) != 0) {
                    fail(__LINE__, "%s failed as %s, not %s: %s", id, kvlink_finished_cause(f, i),
                         cause, kvlink_finished_reason(f, i));
                }
                kvlink_finished_free(f);
                return;
            }
        }
        EXPECT(kvlink_finished_count(f, KVLINK_RECEIVING) == 0);
        kvlink_finished_free(f);
    }
    fail(__LINE__, "%s did not fail within %.0f s", id, DEADLINE_S);
}

/* kvlink_engine_cancel: an id not in flight, then a read held up by a peer that accepts and
 * never answers, cancelled: it fails at once with a reason that says so. */
static void check_cancel(kvlink_engine *decode) {
    int in_flight = -1;
    CHECK(kvlink_engine_cancel(decode, "c-never-started", &in_flight));
    EXPECT(in_flight == 0);
    CHECK_FAILS(kvlink_engine_cancel(decode, NULL, NULL), KVLINK_E_INVALID, "request_id");

    int fd = socket(AF_INET, SOCK_STREAM, 0);
    EXPECT(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
    EXPECT(listen(fd, 4) == 0);
    socklen_t len = sizeof a;
    EXPECT(getsockname(fd, (struct sockaddr *)&a, &len) == 0);
    char silent[64];
    snprintf(silent, sizeof silent, "127.0.0.1:%u", (unsigned)ntohs(a.sin_port));

    const uint32_t one[1] = {0};
    CHECK(kvlink_engine_read_blocks(decode, silent, "c-cancel", one, one, 1));
    CHECK(kvlink_engine_cancel(decode, "c-cancel", &in_flight));
    EXPECT(in_flight == 1);
    double deadline = now_s() + 10.0;
    int seen = 0;
    while (!seen && now_s() < deadline) {
        kvlink_finished *f = NULL;
        CHECK(kvlink_engine_wait_finished(decode, 200, &f));
        size_t n = kvlink_finished_count(f, KVLINK_FAILED);
        for (size_t i = 0; i < n; i++) {
            if (strcmp(kvlink_finished_id(f, KVLINK_FAILED, i), "c-cancel") == 0) {
                EXPECT(strstr(kvlink_finished_reason(f, i), "cancel") != NULL);
                EXPECT(strcmp(kvlink_finished_cause(f, i), "cancelled") == 0);
                seen = 1;
            }
        }
        kvlink_finished_free(f);
    }
    EXPECT(seen);
    CHECK(kvlink_engine_cancel(decode, "c-cancel", &in_flight));
    EXPECT(in_flight == 0);
    close(fd);
}

static kvlink_engine *start_engine(const char *name) {
    kvlink_config cfg = KVLINK_CONFIG_INIT;
    CHECK(kvlink_config_default(&cfg));
    EXPECT(cfg.tp_size == 1 && cfg.tcp_streams > 0 && cfg.listen != NULL);
    EXPECT(strcmp(cfg.listen, "127.0.0.1:0") == 0);
    cfg.engine_id = name;
    /* TCP keeps the test independent of whatever RDMA devices the machine has. */
    cfg.transport = KVLINK_TRANSPORT_TCP;
    cfg.request_timeout_ms = 20000;
    kvlink_engine *engine = NULL;
    CHECK(kvlink_engine_start(&cfg, &engine));
    EXPECT(engine != NULL);
    EXPECT(kvlink_last_error()[0] == '\0');
    /* What the engine found, and GPU memory refused cleanly where no runtime knows it. */
    char caps[4096];
    CHECK(kvlink_engine_capabilities(engine, caps, sizeof caps));
    EXPECT(strstr(caps, "transport tcp:") != NULL && strstr(caps, "memory cuda:") != NULL);
    static uint8_t not_gpu[4096];
    uint32_t region = 0;
    int rc = kvlink_engine_register_device(engine, (uint64_t)(uintptr_t)not_gpu, sizeof not_gpu,
                                           &region);
    EXPECT(rc == KVLINK_E_GPU || rc == KVLINK_E_INVALID);
    EXPECT(strstr(kvlink_last_error(), "GPU") != NULL);
    return engine;
}

/* kvlink_config as a program built against an older header has it: without the two fields
 * appended last (lease_ms, session_idle_ms), 96 bytes. */
struct older_config {
    uint64_t size;
    const char *listen;
    const char *advertise_host;
    const char *engine_id;
    uint32_t tp_rank, tp_size, transport, tcp_streams;
    uint64_t request_timeout_ms, abort_timeout_ms;
    uint32_t gpu, staging_buffers;
    uint64_t staging_chunk_bytes;
    const char *auth_key;
    uint32_t insecure;
};

/* An older program's config is filled and read as far as its size says, never past it (the
 * bytes after it are garbage that would fail the start if they were read); a newer
 * program's bigger config is refused, naming its size. */
static void check_older_header(void) {
    union {
        struct older_config cfg;
        unsigned char bytes[sizeof(kvlink_config) + 16];
    } buf;
    EXPECT(sizeof(struct older_config) == 96 && sizeof(kvlink_config) == KVLINK_CONFIG_SIZE);
    memset(&buf, 0xAB, sizeof buf);
    buf.cfg.size = sizeof(struct older_config);
    CHECK(kvlink_config_default((kvlink_config *)&buf.cfg));
    EXPECT(buf.cfg.size == 96 && buf.cfg.tp_size == 1 && buf.cfg.insecure == 0);
    EXPECT(strcmp(buf.cfg.listen, "127.0.0.1:0") == 0);
    for (size_t i = sizeof(struct older_config); i < sizeof buf.bytes; i++) {
        EXPECT(buf.bytes[i] == 0xAB);
    }
    buf.cfg.transport = KVLINK_TRANSPORT_TCP;
    buf.cfg.engine_id = "c-older";
    kvlink_engine *engine = NULL;
    CHECK(kvlink_engine_start((const kvlink_config *)&buf.cfg, &engine));
    EXPECT(engine != NULL);
    kvlink_engine_free(engine);
    buf.cfg.size = sizeof(kvlink_config) + 8;
    CHECK_FAILS(kvlink_config_default((kvlink_config *)&buf.cfg), KVLINK_E_INVALID, "config->size is");
    CHECK_FAILS(kvlink_engine_start((const kvlink_config *)&buf.cfg, &engine), KVLINK_E_INVALID,
                "config->size is");
}

static void set_layout(kvlink_engine *engine, uint32_t region) {
    kvlink_tensor tensors[TENSORS];
    memset(tensors, 0, sizeof tensors);
    for (unsigned t = 0; t < TENSORS; t++) {
        tensors[t].region = region;
        tensors[t].num_blocks = BLOCKS;
        tensors[t].offset = t * TENSOR_BYTES;
        tensors[t].block_stride = BLOCK_BYTES;
        tensors[t].block_bytes = BLOCK_BYTES;
    }
    CHECK(kvlink_engine_set_layout(engine, 16, "bf16", tensors, TENSORS));
}

static void check_argument_errors(kvlink_engine *decode) {
    kvlink_config cfg = KVLINK_CONFIG_INIT;
    kvlink_engine *none = NULL;
    CHECK(kvlink_config_default(&cfg));
    CHECK_FAILS(kvlink_engine_start(&cfg, NULL), KVLINK_E_INVALID, "out is NULL");
    cfg.transport = 7;
    CHECK_FAILS(kvlink_engine_start(&cfg, &none), KVLINK_E_INVALID, "transport");
    EXPECT(none == NULL);
    CHECK(kvlink_config_default(&cfg));
    EXPECT(cfg.session_idle_ms == 120000 && cfg.lease_ms == 30000 && cfg.spin_us == 50);
    cfg.session_idle_ms = KVLINK_TIMEOUT_MAX_MS + 1;
    CHECK_FAILS(kvlink_engine_start(&cfg, &none), KVLINK_E_INVALID, "config->session_idle_ms");
    EXPECT(none == NULL);
    CHECK(kvlink_config_default(&cfg));
    cfg.spin_us = 20000;
    CHECK_FAILS(kvlink_engine_start(&cfg, &none), KVLINK_E_INVALID, "spin");
    EXPECT(none == NULL);
    CHECK(kvlink_config_default(&cfg));
    cfg.auth_key = "short";
    CHECK_FAILS(kvlink_engine_start(&cfg, &none), KVLINK_E_INVALID, "at least 16");
    CHECK(kvlink_config_default(&cfg));
    cfg.listen = "0.0.0.0:0";
    CHECK_FAILS(kvlink_engine_start(&cfg, &none), KVLINK_E_INVALID, "KVLINK_AUTH_KEY");
    EXPECT(none == NULL);
    CHECK_FAILS(kvlink_config_default(NULL), KVLINK_E_INVALID, "NULL");

    char small[4];
    CHECK_FAILS(kvlink_engine_handshake_address(decode, small, sizeof small), KVLINK_E_INVALID,
                "too small");
    EXPECT(small[0] == '\0');
    CHECK_FAILS(kvlink_engine_handshake_address(NULL, small, sizeof small), KVLINK_E_INVALID,
                "engine is NULL");

    uint32_t region = 0;
    uint8_t *ptr = NULL;
    CHECK_FAILS(kvlink_engine_allocate_host(decode, 0, false, &region, &ptr), KVLINK_E_INVALID,
                "empty");
    CHECK_FAILS(kvlink_engine_allocate_host(decode, 4096, false, NULL, &ptr), KVLINK_E_INVALID,
                "region_id is NULL");

    kvlink_tensor bad = {.region = 999, .num_blocks = 1, .offset = 0, .block_stride = 64,
                         .block_bytes = 64, .group = 0, .heads_total = 0};
    CHECK_FAILS(kvlink_engine_set_layout(decode, 16, "bf16", &bad, 1), KVLINK_E_INVALID,
                "not registered");
    CHECK_FAILS(kvlink_engine_set_layout(decode, 16, "bf16", NULL, 1), KVLINK_E_INVALID,
                "tensors is NULL");
    CHECK_FAILS(kvlink_engine_set_layout(decode, 16, "\xff\xfe", &bad, 1), KVLINK_E_INVALID,
                "UTF-8");

    kvlink_finished *f = NULL;
    CHECK_FAILS(kvlink_engine_wait_finished(decode, KVLINK_TIMEOUT_MAX_MS + 1, &f),
                KVLINK_E_INVALID, "7 days");
    EXPECT(f == NULL);
}

static void check_registered_memory(kvlink_engine *decode, uint32_t layout_region) {
    /* Caller-owned memory: registered, deregistered, then freed by the caller. */
    size_t len = 1 << 16;
    void *mem = malloc(len);
    EXPECT(mem != NULL);
    uint32_t region = 0;
    CHECK(kvlink_engine_register_host(decode, mem, len, &region));
    EXPECT(region != 0 && region != layout_region);
    CHECK(kvlink_engine_deregister(decode, region));
    free(mem);
    CHECK_FAILS(kvlink_engine_deregister(decode, region), KVLINK_E_INVALID, "not registered");
    CHECK_FAILS(kvlink_engine_deregister(decode, layout_region), KVLINK_E_INVALID,
                "used by the KV layout");
    CHECK_FAILS(kvlink_engine_register_host(decode, NULL, 64, &region), KVLINK_E_INVALID,
                "null pointer");
}

static void check_aggregator(const kvlink_finished *rank0) {
    kvlink_aggregator *agg = NULL;
    CHECK_FAILS(kvlink_aggregator_new(0, 1000, &agg), KVLINK_E_INVALID, "world_size");
    CHECK(kvlink_aggregator_new(2, 60000, &agg));

    /* Rank 1's report, as a scheduler would rebuild it from another process. */
    kvlink_finished *rank1 = NULL;
    CHECK(kvlink_finished_new(&rank1));
    CHECK(kvlink_finished_add(rank1, KVLINK_RECEIVING, REQ));
    CHECK(kvlink_finished_add(rank1, KVLINK_RECEIVING, "c-req-2"));
    CHECK_FAILS(kvlink_finished_add(rank1, KVLINK_FAILED, "x"), KVLINK_E_INVALID,
                "kvlink_finished_add_failed");
    kvlink_finished *rank0_extra = NULL;
    CHECK(kvlink_finished_new(&rank0_extra));
    CHECK(kvlink_finished_add_failed(rank0_extra, KVLINK_SIDE_RECV, "c-req-2", false, "boom"));

    kvlink_finished *out = NULL;
    CHECK(kvlink_aggregator_report(agg, 0, rank0));
    CHECK(kvlink_aggregator_take(agg, &out));
    EXPECT(kvlink_finished_count(out, KVLINK_RECEIVING) == 0); /* rank 1 has not reported */
    kvlink_finished_free(out);

    CHECK_FAILS(kvlink_aggregator_report(agg, 2, rank1), KVLINK_E_INVALID, "world size");
    CHECK(kvlink_aggregator_report(agg, 1, rank1));
    CHECK(kvlink_aggregator_report(agg, 0, rank0_extra));
    CHECK(kvlink_aggregator_take(agg, &out));
    EXPECT(kvlink_finished_count(out, KVLINK_RECEIVING) == 1);
    EXPECT(strcmp(kvlink_finished_id(out, KVLINK_RECEIVING, 0), REQ) == 0);
    EXPECT(kvlink_finished_count(out, KVLINK_FAILED) == 1);
    EXPECT(strcmp(kvlink_finished_id(out, KVLINK_FAILED, 0), "c-req-2") == 0);
    EXPECT(strstr(kvlink_finished_reason(out, 0), "rank 0: boom") != NULL);
    EXPECT(kvlink_finished_side(out, 0) == KVLINK_SIDE_RECV);
    EXPECT(kvlink_finished_expired(out, 0) == 0);

    /* Accessor misuse: failure values plus a last error. */
    EXPECT(kvlink_finished_id(out, 5, 0) == NULL);
    EXPECT(strstr(kvlink_last_error(), "kind is 5") != NULL);
    EXPECT(kvlink_finished_id(out, KVLINK_RECEIVING, 1) == NULL);
    EXPECT(strstr(kvlink_last_error(), "out of range") != NULL);
    EXPECT(kvlink_finished_reason(out, 3) == NULL);
    EXPECT(kvlink_finished_expired(out, 3) == KVLINK_E_INVALID);
    EXPECT(kvlink_finished_side(NULL, 0) == KVLINK_E_INVALID);
    EXPECT(kvlink_finished_count(NULL, KVLINK_SENDING) == 0);
    EXPECT(strstr(kvlink_last_error(), "finished is NULL") != NULL);

    kvlink_finished_free(out);
    kvlink_finished_free(rank1);
    kvlink_finished_free(rank0_extra);
    kvlink_aggregator_free(agg);
}

/* A decode-local id distinct from the prefill's, and a rejected request freed at once. */
static void check_local_ids(kvlink_engine *prefill, kvlink_engine *decode, const char *peer) {
    const uint32_t remote[2] = {9, 4};
    const uint32_t local[2] = {40, 41};
    CHECK(kvlink_engine_hold_blocks(prefill, "c-prefill-id", remote, 2, NULL, 30000, NULL));
    CHECK(kvlink_engine_read_blocks_as(decode, peer, "c-decode-id", "c-prefill-id", local, remote,
                                       2));
    kvlink_finished *got = wait_for(decode, KVLINK_RECEIVING, "c-decode-id", "decode (local id)");
    EXPECT(!contains(got, KVLINK_RECEIVING, "c-prefill-id"));
    kvlink_finished_free(got);
    kvlink_finished *sent = wait_for(prefill, KVLINK_SENDING, "c-prefill-id", "prefill (remote id)");
    kvlink_finished_free(sent);
    CHECK_FAILS(kvlink_engine_read_blocks_as(decode, peer, "c-x", "", local, remote, 2),
                KVLINK_E_INVALID, "remote request id");

    /* Held for 30 s, rejected by the decode: the prefill reports it failed within seconds. */
    CHECK(kvlink_engine_hold_blocks(prefill, "c-rejected", remote, 2, NULL, 30000, NULL));
    CHECK(kvlink_engine_reject(decode, peer, "c-rejected", 0, "admission refused"));
    double deadline = now_s() + 10.0;
    int seen = 0;
    while (!seen && now_s() < deadline) {
        kvlink_finished *f = NULL;
        CHECK(kvlink_engine_wait_finished(prefill, 200, &f));
        for (size_t i = 0; i < kvlink_finished_count(f, KVLINK_FAILED); i++) {
            if (strcmp(kvlink_finished_id(f, KVLINK_FAILED, i), "c-rejected") == 0) {
                EXPECT(strstr(kvlink_finished_reason(f, i), "admission refused") != NULL);
                EXPECT(strcmp(kvlink_finished_cause(f, i), "peer") == 0);
                seen = 1;
            }
        }
        kvlink_finished_free(f);
    }
    EXPECT(seen);

    /* Released by the prefill: the grant ends, nothing is reported, a read is refused. */
    int was = -1;
    CHECK(kvlink_engine_hold_blocks(prefill, "c-released", remote, 2, NULL, 30000, NULL));
    CHECK(kvlink_engine_release(prefill, "c-released", &was));
    EXPECT(was == 1);
    CHECK(kvlink_engine_release(prefill, "c-released", &was));
    EXPECT(was == 0);
    CHECK(kvlink_engine_read_blocks(decode, peer, "c-released", local, remote, 2));
    kvlink_finished *refused = NULL;
    deadline = now_s() + 10.0;
    seen = 0;
    while (!seen && now_s() < deadline) {
        CHECK(kvlink_engine_wait_finished(decode, 200, &refused));
        for (size_t i = 0; i < kvlink_finished_count(refused, KVLINK_FAILED); i++) {
            if (strcmp(kvlink_finished_id(refused, KVLINK_FAILED, i), "c-released") == 0) {
                EXPECT(strstr(kvlink_finished_reason(refused, i), "not held") != NULL);
                seen = 1;
            }
        }
        EXPECT(!contains(refused, KVLINK_RECEIVING, "c-released"));
        kvlink_finished_free(refused);
    }
    EXPECT(seen);
}

/* A progressive read: the decode follows a hold that grows part by part, and hears the request
 * received only once the prefill sealed it. */
static void check_progressive(kvlink_engine *prefill, kvlink_engine *decode, const char *peer) {
    const uint32_t local[3] = {50, 51, 52};
    const uint32_t *lp[1] = {local};
    const size_t lc[1] = {3};
    CHECK(kvlink_engine_follow(decode, peer, "c-grow", NULL, lp, lc, 1, 0, 10000, 10000));
    const uint32_t first[2] = {5, 6};
    const uint32_t *fp[1] = {first};
    const size_t fc[1] = {2};
    uint64_t token = 0;
    CHECK(kvlink_engine_hold_growing(prefill, "c-grow", fp, fc, 1, NULL, 30000, &token));
    EXPECT(token != 0);
    CHECK_FAILS(kvlink_engine_seal_hold(prefill, "c-none"), KVLINK_E_INVALID, "not held");
    const uint32_t rest[1] = {7};
    const uint32_t *rp[1] = {rest};
    const size_t rc[1] = {1};
    /* Its tensors final in two halves (a step's layers, a group at a time). */
    CHECK(kvlink_engine_extend_hold(prefill, "c-grow", rp, rc, 1, 0, TENSORS / 2));
    CHECK_FAILS(kvlink_engine_seal_hold(prefill, "c-grow"), KVLINK_E_INVALID, "to come");
    const size_t none[1] = {0};
    CHECK(kvlink_engine_extend_hold(prefill, "c-grow", rp, none, 1, TENSORS / 2, TENSORS));
    CHECK_FAILS(kvlink_engine_extend_hold(prefill, "c-grow", rp, rc, 1, 0, 0), KVLINK_E_INVALID,
                "already");
    /* Not sealed: not received yet. */
    kvlink_finished *f = NULL;
    CHECK(kvlink_engine_wait_finished(decode, 300, &f));
    EXPECT(!contains(f, KVLINK_RECEIVING, "c-grow") && !contains(f, KVLINK_FAILED, "c-grow"));
    kvlink_finished_free(f);
    CHECK(kvlink_engine_seal_hold(prefill, "c-grow"));
    CHECK_FAILS(kvlink_engine_seal_hold(prefill, "c-grow"), KVLINK_E_INVALID, "sealed");
    kvlink_finished *got = wait_for(decode, KVLINK_RECEIVING, "c-grow", "decode (progressive)");
    kvlink_finished_free(got);
    kvlink_finished *sent = wait_for(prefill, KVLINK_SENDING, "c-grow", "prefill (progressive)");
    kvlink_finished_free(sent);
}

/* A progressive read by a decode that cached the prompt's first block: it skips it, and reads
 * the prefill's other two into its two blocks (without the skip, its two blocks would not
 * pair with the prefill's three, and the read would fail). */
static void check_progressive_skip(kvlink_engine *prefill, kvlink_engine *decode,
                                   const char *peer) {
    const uint32_t local[2] = {55, 56};
    const uint32_t *lp[1] = {local};
    const size_t lc[1] = {2};
    const uint32_t skip[1] = {1};
    CHECK(kvlink_engine_follow_skip(decode, peer, "c-skip", NULL, lp, lc, 1, skip, 0, 10000,
                                    10000));
    const uint32_t held[3] = {8, 9, 10};
    const uint32_t *hp[1] = {held};
    const size_t hc[1] = {3};
    uint64_t token = 0;
    CHECK(kvlink_engine_hold_growing(prefill, "c-skip", hp, hc, 1, NULL, 30000, &token));
    CHECK(kvlink_engine_seal_hold(prefill, "c-skip"));
    kvlink_finished *got = wait_for(decode, KVLINK_RECEIVING, "c-skip", "decode (skip)");
    kvlink_finished_free(got);
    kvlink_finished *sent = wait_for(prefill, KVLINK_SENDING, "c-skip", "prefill (skip)");
    kvlink_finished_free(sent);
}

/* The KV-event publisher from C: a batch of each event kind published, counters read.
 * (The stream itself is checked against kvlink's subscriber in the crate's unit tests.) */
static void check_event_publisher(void) {
    kvlink_event_publisher *pub = NULL;
    CHECK(kvlink_event_publisher_start("tcp://" "*:0", NULL, "kv@c", 0, KVLINK_EVENTS_CURRENT,
                                       &pub));
    char ep[KVLINK_ADDRESS_MAX];
    CHECK(kvlink_event_publisher_endpoint(pub, ep, sizeof ep));
    EXPECT(strncmp(ep, "tcp://", 6) == 0);
    CHECK_FAILS(kvlink_event_publisher_start("udp://nowhere", NULL, NULL, 0,
                                             KVLINK_EVENTS_CURRENT, &pub), KVLINK_E_INVALID,
                "endpoint");
    kvlink_event_batch *batch = NULL;
    CHECK(kvlink_event_batch_new(-1.0, -1, &batch));
    const uint64_t hashes[2] = {UINT64_MAX, 42};
    uint32_t tokens[16];
    for (unsigned i = 0; i < 16; i++) {
        tokens[i] = i;
    }
    CHECK(kvlink_event_batch_block_stored(batch, hashes, 2, NULL, tokens, 16, 16, "GPU"));
    CHECK(kvlink_event_batch_block_removed(batch, hashes, 1, "GPU"));
    CHECK(kvlink_event_batch_all_cleared(batch, NULL));
    CHECK_FAILS(kvlink_event_batch_block_removed(batch, hashes, 0, NULL), KVLINK_E_INVALID,
                "block hash");
    CHECK(kvlink_event_publisher_publish(pub, batch));
    /* Sent on the publisher's thread: counted within moments. */
    kvlink_event_stats stats;
    double until = now_s() + 5.0;
    for (;;) {
        CHECK(kvlink_event_publisher_stats(pub, &stats));
        if (stats.published >= 1 || now_s() >= until) {
            break;
        }
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    EXPECT(stats.published == 1 && stats.next_seq == 1 && stats.dropped == 0);
    kvlink_event_batch_free(batch);
    kvlink_event_publisher_free(pub, 2000);
}

/* Application messages: in order, with the sender's engine id; limits and misuse refused. */
static void check_messages(kvlink_engine *prefill, kvlink_engine *decode, const char *peer) {
    const char *bodies[3] = {"want room 7", "", "third"};
    for (int i = 0; i < 3; i++) {
        CHECK(kvlink_engine_send_message(decode, peer, (const uint8_t *)bodies[i],
                                         strlen(bodies[i])));
    }
    static uint8_t big[KVLINK_MESSAGE_MAX + 1];
    CHECK_FAILS(kvlink_engine_send_message(decode, peer, big, sizeof big), KVLINK_E_INVALID,
                "limit");
    CHECK_FAILS(kvlink_engine_send_message(decode, peer, NULL, 4), KVLINK_E_INVALID, "NULL");
    size_t got = 0;
    const char *from[3];
    char text[3][32];
    double deadline = now_s() + 10.0;
    while (got < 3 && now_s() < deadline) {
        kvlink_messages *m = NULL;
        CHECK(kvlink_engine_take_messages(prefill, &m));
        for (size_t i = 0; i < kvlink_messages_count(m) && got < 3; i++, got++) {
            const uint8_t *body = NULL;
            size_t len = 0;
            CHECK(kvlink_messages_get(m, i, &from[got], &body, &len));
            EXPECT(len < sizeof text[got]);
            memcpy(text[got], body, len);
            text[got][len] = '\0';
            EXPECT(strcmp(from[got], "c-decode") == 0);
        }
        CHECK_FAILS(kvlink_messages_get(m, 99, NULL, NULL, NULL), KVLINK_E_INVALID, "range");
        kvlink_messages_free(m);
        struct timespec pause = {0, 5000000};
        nanosleep(&pause, NULL);
    }
    if (got != 3) {
        fail(__LINE__, "%zu of 3 messages arrived", got);
    }
    for (int i = 0; i < 3; i++) {
        EXPECT(strcmp(text[i], bodies[i]) == 0);
    }
    EXPECT(kvlink_messages_count(NULL) == 0);
    kvlink_messages_free(NULL);
}

#define TP_HEAD_BYTES 64
#define TP_BLOCKS 8

static uint8_t head_pattern(unsigned tensor, unsigned block, unsigned head, unsigned byte) {
    return (uint8_t)(tensor * 37u + block * 11u + head * 101u + byte * 3u + 1u);
}

/* An engine at rank `rank` of a TP group of `size`, with two tensors of 2 KV heads over all
 * ranks (head-major blocks), tensor 0 in block group 0 and tensor 1 in block group 1. Its
 * memory holds `head_pattern` of each global head when `fill` is set. */
static kvlink_engine *tp_engine(const char *name, uint32_t rank, uint32_t size, int fill,
                                uint8_t **mem) {
    kvlink_config cfg = KVLINK_CONFIG_INIT;
    CHECK(kvlink_config_default(&cfg));
    cfg.engine_id = name;
    cfg.transport = KVLINK_TRANSPORT_TCP;
    cfg.tp_rank = rank;
    cfg.tp_size = size;
    kvlink_engine *engine = NULL;
    CHECK(kvlink_engine_start(&cfg, &engine));
    uint32_t local = 2 / size, block = local * TP_HEAD_BYTES, region = 0;
    CHECK(kvlink_engine_allocate_host(engine, 2ull * TP_BLOCKS * block, false, &region, mem));
    kvlink_tensor t[2];
    memset(t, 0, sizeof t);
    for (unsigned i = 0; i < 2; i++) {
        t[i].region = region;
        t[i].num_blocks = TP_BLOCKS;
        t[i].offset = (uint64_t)i * TP_BLOCKS * block;
        t[i].block_stride = block;
        t[i].block_bytes = block;
        t[i].group = i;
        t[i].heads_total = 2;
        t[i].heads_local = local;
        t[i].head_runs = 1;
        for (unsigned b = 0; fill && b < TP_BLOCKS; b++) {
            for (unsigned h = 0; h < local; h++) {
                for (unsigned k = 0; k < TP_HEAD_BYTES; k++) {
                    (*mem)[t[i].offset + b * block + h * TP_HEAD_BYTES + k] =
                        head_pattern(i, b, rank * local + h, k);
                }
            }
        }
    }
    CHECK(kvlink_engine_set_layout(engine, 16, "bf16", t, 2));
    return engine;
}

/* A prefill of TP 1 read by a decode of TP 2 (each rank its own head of every block), with
 * block ids per block group; every byte checked, and the prefill's send finishes once both
 * decode ranks confirmed. */
static void check_tp_and_groups(void) {
    uint32_t first = 9, count = 9;
    CHECK(kvlink_tp_sources(1, 2, 1, &first, &count));
    EXPECT(first == 0 && count == 1);
    CHECK(kvlink_tp_sources(0, 1, 4, &first, &count));
    EXPECT(first == 0 && count == 4);
    CHECK_FAILS(kvlink_tp_sources(0, 3, 2, &first, &count), KVLINK_E_INVALID, "multiple");

    uint8_t *p_mem = NULL, *d_mem[2] = {NULL, NULL};
    kvlink_engine *prefill = tp_engine("c-tp-prefill", 0, 1, 1, &p_mem);
    kvlink_engine *decode[2] = {tp_engine("c-tp-decode0", 0, 2, 0, &d_mem[0]),
                                tp_engine("c-tp-decode1", 1, 2, 0, &d_mem[1])};
    char addr[KVLINK_ADDRESS_MAX];
    CHECK(kvlink_engine_handshake_address(prefill, addr, sizeof addr));
    const char *peers[1] = {addr};
    const uint32_t l0[2] = {1, 2}, l1[1] = {3}, r0[2] = {5, 0}, r1[1] = {7};
    const uint32_t *local[2] = {l0, l1}, *remote[2] = {r0, r1};
    const size_t counts[2] = {2, 1};
    uint64_t token = 0;
    CHECK(kvlink_engine_hold_groups(prefill, "c-tp", remote, counts, 2, NULL, 30000, &token));
    EXPECT(token != 0);
    CHECK_FAILS(kvlink_engine_hold_groups(prefill, "c-tp-one", remote, counts, 1, NULL, 0, NULL),
                KVLINK_E_INVALID, "block groups");
    CHECK_FAILS(kvlink_engine_read(decode[0], "x", NULL, peers, 1, 2, local, remote, counts, 2, 0),
                KVLINK_E_INVALID, "tp_group");
    /* A read naming another hold of the same id (an earlier one, say) is never confirmed. */
    CHECK(kvlink_engine_read(decode[0], "c-tp", NULL, peers, 1, 1, local, remote, counts, 2,
                             token + 1));
    expect_failed(decode[0], "c-tp", "unconfirmed");
    for (unsigned d = 0; d < 2; d++) {
        CHECK(kvlink_engine_read(decode[d], "c-tp", NULL, peers, 1, 1, local, remote, counts, 2,
                                 token));
    }
    for (unsigned d = 0; d < 2; d++) {
        kvlink_finished *f = wait_for(decode[d], KVLINK_RECEIVING, "c-tp", "tp decode");
        kvlink_finished_free(f);
        for (unsigned t = 0; t < 2; t++) {
            for (unsigned k = 0; k < counts[t]; k++) {
                const uint8_t *got = d_mem[d] + (uint64_t)t * TP_BLOCKS * TP_HEAD_BYTES +
                                     local[t][k] * TP_HEAD_BYTES;
                for (unsigned i = 0; i < TP_HEAD_BYTES; i++) {
                    if (got[i] != head_pattern(t, remote[t][k], d, i)) {
                        fail(__LINE__, "decode rank %u tensor %u block %u byte %u", d, t,
                             local[t][k], i);
                    }
                }
            }
        }
    }
    kvlink_finished *sent = wait_for(prefill, KVLINK_SENDING, "c-tp", "tp prefill");
    kvlink_finished_free(sent);
    kvlink_engine_free(decode[0]);
    kvlink_engine_free(decode[1]);
    kvlink_engine_free(prefill);
}

#define RS_TOKEN_BYTES 8
#define RS_BLOCKS 8

/* An engine with one tensor of `tokens`-token blocks (`[tokens, bytes]`, one token run) whose
 * token `s` of block `b` holds `(b * tokens + s) % 251` in each byte when `fill` is set. */
static kvlink_engine *resized_engine(const char *name, uint32_t tokens, int fill, uint8_t **mem) {
    kvlink_config cfg = KVLINK_CONFIG_INIT;
    CHECK(kvlink_config_default(&cfg));
    cfg.engine_id = name;
    cfg.transport = KVLINK_TRANSPORT_TCP;
    kvlink_engine *engine = NULL;
    CHECK(kvlink_engine_start(&cfg, &engine));
    uint32_t block = tokens * RS_TOKEN_BYTES, region = 0;
    CHECK(kvlink_engine_allocate_host(engine, (uint64_t)RS_BLOCKS * block, false, &region, mem));
    for (unsigned i = 0; fill && i < RS_BLOCKS * block; i++) {
        (*mem)[i] = (uint8_t)((i / RS_TOKEN_BYTES) % 251);
    }
    kvlink_tensor t;
    memset(&t, 0, sizeof t);
    t.region = region;
    t.num_blocks = RS_BLOCKS;
    t.block_stride = block;
    t.block_bytes = block;
    t.token_runs = 1;
    CHECK(kvlink_engine_set_layout(engine, tokens, "bf16", &t, 1));
    return engine;
}

/* A decode of 16-token blocks reads 24 tokens of a prefill of 4-token blocks (6 blocks into
 * 2), token by token in place; the prefill's send finishes. */
static void check_resized(void) {
    uint8_t *p_mem = NULL, *d_mem = NULL;
    kvlink_engine *prefill = resized_engine("c-rs-prefill", 4, 1, &p_mem);
    kvlink_engine *decode = resized_engine("c-rs-decode", 16, 0, &d_mem);
    char addr[KVLINK_ADDRESS_MAX];
    CHECK(kvlink_engine_handshake_address(prefill, addr, sizeof addr));
    const char *peers[1] = {addr};
    const uint32_t r0[6] = {7, 2, 5, 0, 3, 6}, l0[2] = {4, 1};
    const uint32_t *local[1] = {l0}, *remote[1] = {r0};
    const size_t local_counts[1] = {2}, remote_counts[1] = {6}, wrong[1] = {3};
    CHECK(kvlink_engine_hold_blocks(prefill, "c-rs", r0, 6, NULL, 30000, NULL));
    CHECK_FAILS(kvlink_engine_read_resized(decode, "c-rs", NULL, peers, 1, 0, local, wrong,
                                           remote, remote_counts, 1, 4, NULL, 0),
                KVLINK_E_INVALID, "need");
    CHECK(kvlink_engine_read_resized(decode, "c-rs", NULL, peers, 1, 0, local, local_counts,
                                     remote, remote_counts, 1, 4, NULL, 0));
    kvlink_finished *f = wait_for(decode, KVLINK_RECEIVING, "c-rs", "resized decode");
    kvlink_finished_free(f);
    for (unsigned p = 0; p < 24; p++) {
        unsigned want = (r0[p / 4] * 4 + p % 4) % 251;
        const uint8_t *got = d_mem + (uint64_t)l0[p / 16] * 16 * RS_TOKEN_BYTES +
                             (p % 16) * RS_TOKEN_BYTES;
        for (unsigned i = 0; i < RS_TOKEN_BYTES; i++) {
            if (got[i] != want) {
                fail(__LINE__, "token %u byte %u: %u, not %u", p, i, got[i], want);
            }
        }
    }
    kvlink_finished *sent = wait_for(prefill, KVLINK_SENDING, "c-rs", "resized prefill");
    kvlink_finished_free(sent);
    kvlink_engine_free(decode);
    kvlink_engine_free(prefill);
}

int main(void) {
    EXPECT(kvlink_version() != NULL && kvlink_version()[0] != '\0');
    kvlink_engine *prefill = start_engine("c-prefill");
    kvlink_engine *decode = start_engine("c-decode");
    check_argument_errors(decode);
    check_older_header();

    char peer[KVLINK_ADDRESS_MAX];
    CHECK(kvlink_engine_handshake_address(prefill, peer, sizeof peer));
    EXPECT(strncmp(peer, "127.0.0.1:", 10) == 0);

    uint32_t p_region = 0, d_region = 0;
    uint8_t *p_mem = NULL, *d_mem = NULL;
    CHECK(kvlink_engine_allocate_host(prefill, REGION_BYTES, false, &p_region, &p_mem));
    CHECK(kvlink_engine_allocate_host(decode, REGION_BYTES, true, &d_region, &d_mem));
    EXPECT(p_mem != NULL && d_mem != NULL);
    for (unsigned t = 0; t < TENSORS; t++) {
        for (unsigned b = 0; b < BLOCKS; b++) {
            uint8_t *block = p_mem + t * TENSOR_BYTES + (uint64_t)b * BLOCK_BYTES;
            for (unsigned i = 0; i < BLOCK_BYTES; i++) {
                block[i] = pattern(t, b, i);
            }
        }
    }
    set_layout(prefill, p_region);

    /* Before the decode side has a layout, reads are refused. */
    uint32_t one = 0;
    CHECK_FAILS(kvlink_engine_read_blocks(decode, peer, "c-early", &one, &one, 1),
                KVLINK_E_INVALID, "layout");
    set_layout(decode, d_region);

    uint32_t peer_blocks = 0;
    CHECK(kvlink_engine_connect(decode, peer, 10000, &peer_blocks));
    EXPECT(peer_blocks == BLOCKS);

    const uint32_t remote[NREAD] = {3, 60, 17, 5, 42, 8, 0, 63};
    const uint32_t local[NREAD] = {10, 1, 50, 33, 2, 61, 20, 7};

    CHECK(kvlink_engine_hold_blocks(prefill, REQ, remote, NREAD, NULL, 30000, NULL));
    CHECK_FAILS(kvlink_engine_hold_blocks(prefill, "", remote, NREAD, NULL, 0, NULL), KVLINK_E_INVALID,
                "empty");
    CHECK_FAILS(kvlink_engine_hold_blocks(prefill, "no-blocks", remote, 0, NULL, 0, NULL),
                KVLINK_E_INVALID, "block ids");
    const uint32_t outside[1] = {BLOCKS};
    CHECK_FAILS(kvlink_engine_hold_blocks(prefill, "outside", outside, 1, NULL, 0, NULL),
                KVLINK_E_INVALID, "outside");

    /* The error path: a local block id past the end of the cache is refused at once. */
    const uint32_t bad_local[NREAD] = {10, 1, 50, 33, 2, 61, 20, BLOCKS};
    CHECK_FAILS(kvlink_engine_read_blocks(decode, peer, "c-req-bad", bad_local, remote, NREAD),
                KVLINK_E_INVALID, "out of range");
    CHECK_FAILS(kvlink_engine_read_blocks(decode, peer, REQ, local, NULL, NREAD),
                KVLINK_E_INVALID, "remote is NULL");

    CHECK(kvlink_engine_read_blocks(decode, peer, REQ, local, remote, NREAD));
    EXPECT(kvlink_last_error()[0] == '\0');

    kvlink_finished *received = wait_for(decode, KVLINK_RECEIVING, REQ, "decode");
    EXPECT(kvlink_finished_count(received, KVLINK_RECEIVING) >= 1);
    /* What the read moved: every tensor's block of each of the NREAD pairs, over TCP. */
    for (size_t i = 0; i < kvlink_finished_count(received, KVLINK_RECEIVING); i++) {
        if (strcmp(kvlink_finished_id(received, KVLINK_RECEIVING, i), REQ) == 0) {
            kvlink_report r;
            CHECK(kvlink_finished_report(received, i, &r));
            EXPECT(r.bytes == (uint64_t)NREAD * TENSORS * BLOCK_BYTES);
            EXPECT(r.blocks == NREAD && r.segments >= 1 && r.work_requests >= 1);
            EXPECT(r.elapsed_ns > 0 && strcmp(r.transport, "tcp") == 0);
            /* Its timeline, in order: connected, first and last byte, confirmed. */
            EXPECT(r.held_ns != UINT64_MAX && r.connected_ns <= r.first_byte_ns);
            EXPECT(r.first_byte_ns <= r.last_byte_ns && r.last_byte_ns <= r.confirmed_ns);
            EXPECT(r.confirmed_ns != UINT64_MAX && r.confirmed_ns <= r.elapsed_ns);
            EXPECT(strcmp(kvlink_finished_report_peer(received, i), peer) == 0);
        }
    }
    CHECK_FAILS(kvlink_finished_report(received, 1000, NULL), KVLINK_E_INVALID, "out");

    /* Every byte of the blocks read, and nothing else, changed on the decode side. */
    for (unsigned t = 0; t < TENSORS; t++) {
        for (unsigned b = 0; b < BLOCKS; b++) {
            const uint8_t *block = d_mem + t * TENSOR_BYTES + (uint64_t)b * BLOCK_BYTES;
            int source = -1;
            for (unsigned k = 0; k < NREAD; k++) {
                if (local[k] == b) {
                    source = (int)remote[k];
                }
            }
            for (unsigned i = 0; i < BLOCK_BYTES; i++) {
                uint8_t want = source < 0 ? 0 : pattern(t, (unsigned)source, i);
                if (block[i] != want) {
                    fail(__LINE__, "tensor %u block %u byte %u is %u, expected %u (source %d)", t,
                         b, i, block[i], want, source);
                }
            }
        }
    }

    kvlink_finished *sent = wait_for(prefill, KVLINK_SENDING, REQ, "prefill");
    kvlink_finished_free(sent);

    check_registered_memory(decode, d_region);
    check_local_ids(prefill, decode, peer);
    check_progressive(prefill, decode, peer);
    check_progressive_skip(prefill, decode, peer);
    check_messages(prefill, decode, peer);
    check_cancel(decode);
    check_event_publisher();
    check_tp_and_groups();
    check_resized();
    check_aggregator(received);
    kvlink_finished_free(received);

    kvlink_engine_free(decode);
    kvlink_engine_free(prefill);
    kvlink_engine_free(NULL);
    kvlink_finished_free(NULL);
    kvlink_aggregator_free(NULL);

    printf("c transfer ok\n");
    return 0;
}
