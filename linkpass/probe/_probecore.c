/*
 * linkpass.probe._probecore: the per-packet data path of the probe engine, in C.
 *
 * Why C: the Python engine (linkpass/probe/engine.py) does ~7 500 exchanges/s on a core; an
 * agent on a host with 8 NICs x 16 paths at 1 kHz needs 128 000/s. This core does the hot loop
 * (send, receive, reflect, timestamps, authentication, replay windows) with sendmmsg/recvmmsg
 * and the GIL released, and hands completed exchanges to Python as packed records.
 * Decisions stay in Python.
 *
 * The wire format (probe_wire.h) is exactly linkpass/core/wire.py's (tests compare the two byte
 * for byte); the receive path, from the cheapest check to the reflector, is probe_rx.h. Both
 * headers are plain C, so the sanitizer harness (fuzz_harness.c) runs the same code.
 *
 * Sockets are created by Python inside the right network namespace and passed in as fds:
 * per NIC, a UDP socket bound to NIC:4791 with SO_TIMESTAMPNS, and a raw IPPROTO_RAW socket
 * bound to the NIC (headers built here: IPv4 DF, id 0, as the ICRC expects).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "lane_watch.h"
#include "probe_rx.h"

#define MAX_NICS 16
#define MAX_PATHS 4096
#define BATCH 64
#define MAX_DECLARED 16 /* probe sizes an agent may declare beyond its own paths' */
#define XRING_DEFAULT (1 << 17)
/* probes due within this much of a wake-up go out in it: one wake-up (and one sendmmsg) serves
 * many paths instead of one each, which is most of the loop's cost at 1 kHz per path */
#define COALESCE_NS 200000
/* a slower path's probe may go up to this share of its interval early, into a wake-up another
 * path's due probe caused (not a reply's or a lane look's: see send_due): idle paths at 10 Hz
 * then go out a few at a time instead of each in a wake-up of its own (the schedule stays the
 * path's own, so its rate does not change) */
#define EARLY_SHARE 8
/* the loop sleeps at most this long: it bounds how stale the evidence time gets while every path
 * is slow (Python takes batches every 10 ms); changes from Python wake it at once (wfd) */
#define MAX_SLEEP_NS 10000000LL
/* reflector slots looked at per wake-up for idle entries: the whole table every ~0.1-1 s */
#define SWEEP_SLOTS 64
/* lane reports the loop looks at (the agent reads at most this many too) */
#define MAX_LANE_REPORTS 256

/* ---- the engine ------------------------------------------------------------------------- */
typedef struct {
    int rx_fd, tx_fd;
    uint8_t addr[4];
} nic_t;

/* Judging mode (track(True)): the loop matches every reply to its request and hands Python an
 * ordered stream of events instead of one record per exchange, so Python's work per path is a few
 * calls per second rather than one per probe (the detector stays in Python; only the per-probe
 * bookkeeping is here). A request is *on time* if its reply arrives by its deadline, sent time +
 * the path's rto (which the detector computes and pushes with set_rto). Events, in the order the
 * loop learned them, per path:
 *   ANSWERED  on-time replies since the last event of the path: count, seq/rx_count/t1..t4 of the
 *             newest, size = 1 if any was a full-size probe. Flushed before any other event of the
 *             path (so order is kept) and on take_events(all=True).
 *   MISS      a request whose deadline passed with no reply: seq, size, t1 = sent, t4 = deadline.
 *             Judged when the loop has read every packet that arrived before the deadline (the
 *             evidence time), or when a reply to a later request of the path arrived after it.
 *   LATE      a reply that came after its request was judged missed (or that matched none).
 *
 * Confirmation (set_confirm), a poll sequence: each miss of a streak, up to the one that
 * completes `threshold` misses in a row (the one the detector declares the path DOWN on), sends
 * one probe on every path to the same peer, that path's own included, besides their schedule:
 * at once, so a streak's misses come a timeout apart, not a probe interval apart; in the
 * DOWN-making miss's round, the other paths' probes no sooner than `spread_ns` after the streak's
 * first miss was sent (the missed path's own at once). That round's probes are the evidence the
 * data path waits for before it acts on a DOWN (another path of the peer answering on time a
 * probe sent then, agent/decide.py silence_confirmed; the missed path's
 * own probe missing too is what lets it act while the peer's lateness allowance would hold it),
 * instead of the other paths' next scheduled probes (an idle path's is 100 ms away); their
 * on-time answers go to Python at once instead of with the next batch. A round asked for while
 * the peer's previous one of the same kind is still unsent is the same round. Bounded per peer,
 * since a flapping or hostile fabric could otherwise turn every miss into a burst: `burst`
 * rounds, refilled at `per_s` a second; a refused round is counted and the probes keep their
 * schedule. */
enum { EV_ANSWERED = 1, EV_MISS = 2, EV_LATE = 3 };
typedef struct { /* little-endian, 64 bytes: "<IIQIIIIqqqq" */
    uint32_t kind, path_id;
    uint64_t seq;
    uint32_t count, rx_count, size, worst_rtt; /* worst_rtt: ANSWERED's largest round trip, ns */
    int64_t t1, t2, t3, t4;
} ev_t;

#define OUT_SLOTS 128 /* requests awaiting a reply per path; more in flight are judged missed */
typedef struct {
    uint64_t seq;
    int64_t t_sent, deadline;
    uint8_t waiting, size, confirm; /* confirm: sent by a confirmation round */
} out_t;

typedef struct {
    uint32_t path_id, peer_id;
    uint8_t peer[4];
    uint16_t sport, pad;
    int nic;
    int64_t pair_gap_ns; /* > 0: coded pairs, a second probe this long after each first (clock sync) */
    int64_t pair_due; /* when the pending second probe of a pair is due; 0: none */
    int64_t interval_ns, next_due;
    uint32_t size_every, size_count; /* every Nth probe is a full-size one (MTU black holes) */
    uint16_t size_pad;
    /* judging mode */
    int64_t rto_ns;
    out_t *out; /* OUT_SLOTS, by seq */
    uint64_t exp_seq; /* requests below this are judged */
    ev_t agg; /* pending ANSWERED (agg.count > 0) */
    uint64_t first_seq, next_seq, sent; /* replies are to requests in [first_seq, next_seq) */
    uint32_t misses_in_row; /* small probes judged missed since the last reply (the detector's streak) */
    int64_t streak_t1; /* send time of the streak's first miss (agent clock) */
    int64_t confirm_due[2]; /* when a confirmation round's probe goes out (monotonic ns; 0: none):
                             * [0] a streak's round, [1] the DOWN-making miss's */
    int64_t confirm_tat; /* the peer's confirmation budget (GCRA: theoretical arrival time, monotonic ns) */
    replay_t replay;
} path_t;

typedef struct { /* one completed exchange, as handed to Python (little-endian, 48 bytes) */
    uint32_t path_id, rx_count;
    uint64_t seq;
    int64_t t1, t2, t3, t4;
} xrec_t;


struct txbatch;

typedef struct {
    PyObject_HEAD
    int ready; /* __init__ succeeded: every method but __init__ needs it */
    rx_t rx; /* the receive path: key, size and budget checks, reflector, drop counters */
    uint32_t agent_id;
    int nnics, npaths;
    nic_t nics[MAX_NICS];
    path_t *paths;
    /* a new path's first sequence: above every sequence an earlier path sent (seq_floor), and
     * above what an earlier run of the agent can have sent (the wall clock in ns, which grows
     * faster than any path's sequence), so a reflector's replay window for a path id that is
     * reused, now or after a restart, accepts the new path at once */
    uint64_t seq_floor;
    uint64_t paths_gen; /* bumped when a path is added or removed: a path's index may have moved */
    uint16_t declared[MAX_DECLARED]; /* paddings the agent expects from peers (declare_pads) */
    int ndeclared;
    xrec_t *ring;
    uint32_t ring_cap, ring_head, ring_len;
    /* sent requests (only while tracking) and the evidence time: every packet that reached a
     * socket before `evidence_local` is in the rings. A detector may judge a probe missed only up
     * to that time, so neither a late Python nor a descheduled loop can fake a miss. */
    ev_t *evring;
    uint32_t ev_head, ev_len, tracking;
    int efd; /* eventfd: readable when a MISS or LATE is waiting (Python sleeps on it) */
    int wfd; /* eventfd the other way: Python changed something the loop's sleep depends on */
    int notify; /* set under `mu` when one was pushed; the loop signals efd after unlocking */
    int64_t evidence_local;
    uint64_t sent, reflected, replies, received, wakeups, evidence_updates;
    /* confirmation rounds (set_confirm; 0: off), and what they did */
    uint32_t confirm_threshold, confirm_burst;
    int64_t confirm_period_ns, confirm_spread_ns;
    uint64_t confirm_rounds, confirm_probes, confirm_refused;
    /* synthetic clock: local = base_local + (true - base_true) * (1 + rate_ppb / 1e9) */
    int64_t clk_base_true, clk_base_local, clk_rate_ppb;
    uint64_t rng; /* xorshift64* for jitter */
    uint32_t jitter_ppm;
    /* background mode: a native thread runs the loop continuously, so reflecting and receiving
     * never pause for Python; `mu` guards everything the loop and the Python methods share */
    pthread_mutex_t mu;
    pthread_t thread;
    int thread_running;
    volatile int thread_stop;
    int rt_priority; /* > 0: the thread asks for SCHED_FIFO at this priority */
    volatile int rt_status; /* 0 ok / not asked, else the errno of pthread_setschedparam */
    struct txbatch *bg_tx;
    uint8_t *bg_rx;
    /* lane watch (lane_watch.h): every half window the loop reads the job's lane reports and
     * wakes Python only when what its rate rule reads changed, instead of Python waking to look.
     * The reports are any local user's files: a look reads at most LW_LOOK_BYTES of lanes (a
     * report it has no room for keeps its last digest and goes first next time) and runs under
     * `lane_mu` alone, which guards these fields, never under `mu` */
    pthread_mutex_t lane_mu;
    int lane_fds[MAX_LANE_REPORTS]; /* the loop's own duplicates of the agent's descriptors */
    uint64_t lane_h[MAX_LANE_REPORTS]; /* each report's digest as last read */
    int nlanes, lane_first;
    int64_t lane_window_ns, lane_silent_ns, lane_next;
    uint64_t lane_digest, lane_looks, lane_changes, lane_deferred;
    int lane_changed; /* set by a look whose digest differed; lanes_changed() reads and clears it */
    uint8_t *lane_buf; /* LW_MAX_BYTES */
} Core;

static inline int64_t now_ns(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int64_t local_clock(const Core *c, int64_t true_ns) {
    int64_t dt = true_ns - c->clk_base_true;
    return c->clk_base_local + dt + (int64_t)((__int128)dt * c->clk_rate_ppb / 1000000000LL);
}

static inline uint64_t rng_next(Core *c) {
    uint64_t x = c->rng;
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    c->rng = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* a batch of packets to send on one NIC's raw socket */
typedef struct txbatch {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in to[BATCH];
    uint8_t *buf; /* BATCH * MAX_PKT */
    int n;
    int what[BATCH]; /* path index for requests, -1 for replies */
    uint64_t seq[BATCH];
    int64_t t1[BATCH];
    uint8_t size_probe[BATCH];
    uint8_t confirm[BATCH];
    uint32_t pid[BATCH]; /* path id for requests */
    int8_t err[BATCH]; /* after tx_send: -1 sent, else the drop it counts as */
    uint64_t gen; /* the paths' generation when the batch was filled (Core.paths_gen) */
} txbatch_t;

static ev_t *ev_push(Core *c) {
    c->notify = 1; /* ANSWERED is pushed only while a MISS/LATE or a take needs it: wake Python */
    if (c->ev_len == c->ring_cap) { c->rx.drops[D_RING_FULL]++; return NULL; }
    ev_t *e = &c->evring[(c->ev_head + c->ev_len++) % c->ring_cap];
    memset(e, 0, sizeof *e);
    return e;
}

static void flush_answered(Core *c, path_t *pt) {
    if (!pt->agg.count) return;
    ev_t *e = ev_push(c);
    if (e) *e = pt->agg;
    pt->agg.count = 0;
    pt->agg.size = 0;
    pt->agg.worst_rtt = 0;
}

static void wake_loop(Core *c);

/* a DOWN-making miss whose round's other probes go out at least this much later wakes Python at
 * once (emit_miss): a step taking a DOWN and its streak costs ~0.2-0.7 ms of CPU on the testbed */
#define DOWN_STEP_AHEAD_NS 200000

/* a confirmation round for pt's peer, if its budget allows (see the judging-mode comment); in
 * the round of the DOWN-making miss, the other paths' probes go out no sooner than a host stall's
 * spread after the streak's first miss was sent, since their answers confirm only from then on
 * (agent/failover.py), and the DOWN path's own at once: its miss, due a timeout later, is what
 * rules a stall out, and it is in hand before the others' answers are */
static int64_t confirm_round(Core *c, const path_t *pt, int last) { /* when the round's probes go; 0: refused */
    int64_t now = now_ns(CLOCK_MONOTONIC), tat = now, later = now;
    if (last) {
        int64_t wait = pt->streak_t1 + c->confirm_spread_ns - local_clock(c, now_ns(CLOCK_REALTIME));
        if (wait > 0) later = now + wait;
    }
    int pending = 1; /* the peer's previous round of this kind has not gone out yet: the same round */
    for (int i = 0; i < c->npaths; i++) { /* the peer's budget: the latest its paths hold */
        const path_t *q = &c->paths[i];
        if (q->peer_id != pt->peer_id) continue;
        if (q->confirm_tat > tat) tat = q->confirm_tat;
        if (!q->confirm_due[last]) pending = 0;
    }
    if (!pending) {
        if (tat - now > (int64_t)(c->confirm_burst - 1) * c->confirm_period_ns) { c->confirm_refused++; return 0; }
        tat += c->confirm_period_ns;
        c->confirm_rounds++;
    }
    for (int i = 0; i < c->npaths; i++) {
        path_t *q = &c->paths[i];
        if (q->peer_id != pt->peer_id) continue;
        int64_t due = q == pt ? now : later;
        if (!pending) q->confirm_tat = tat;
        if (!q->confirm_due[last]) c->confirm_probes++;
        if (!q->confirm_due[last] || q->confirm_due[last] > due) q->confirm_due[last] = due;
    }
    wake_loop(c); /* a miss judged on a reply's wake-up: the loop must not sleep before sending */
    return later;
}

static void emit_miss(Core *c, path_t *pt, out_t *o) {
    flush_answered(c, pt);
    int notify = c->notify;
    ev_t *e = ev_push(c);
    if (e) {
        e->kind = EV_MISS; e->path_id = pt->path_id; e->seq = o->seq; e->size = o->size;
        e->t1 = o->t_sent; e->t4 = o->deadline;
    }
    o->waiting = 0;
    /* the detector's streak: full-size probes are the MTU check's, not counted (core/detector.py) */
    if (o->size) return;
    if (++pt->misses_in_row == 1) pt->streak_t1 = o->t_sent;
    if (pt->misses_in_row > c->confirm_threshold) return;
    int last = pt->misses_in_row == c->confirm_threshold;
    int64_t round_at = confirm_round(c, pt, last);
    /* A streak's misses between its first and the DOWN do not wake Python: they come a timeout
     * apart, and a step for each would leave the round's answers queued behind the last one; the
     * round wakes it a round trip later (its answers, or its own misses). The first miss wakes
     * it, so the loop is ready (agent/loop_priority.py), and so does the DOWN-making miss when
     * its round waits for the stall spread: the step that takes the DOWN and the streak's misses
     * then ends before the round's answers arrive, and the step for those is a short one */
    if (round_at && pt->misses_in_row > 1
        && !(last && round_at - now_ns(CLOCK_MONOTONIC) > DOWN_STEP_AHEAD_NS))
        c->notify = notify;
}

/* judge every request of the path, oldest first, whose deadline is before `until` */
static void expire(Core *c, path_t *pt, int64_t until) {
    /* only the last OUT_SLOTS requests can be waiting (track_sent judged the older ones) */
    if (pt->next_seq - pt->exp_seq > OUT_SLOTS) pt->exp_seq = pt->next_seq - OUT_SLOTS;
    for (; pt->exp_seq < pt->next_seq; pt->exp_seq++) {
        out_t *o = &pt->out[pt->exp_seq % OUT_SLOTS];
        if (!o->waiting || o->seq != pt->exp_seq) continue; /* answered (or never sent) */
        if (o->deadline >= until) break;
        emit_miss(c, pt, o);
    }
}

static void track_sent(Core *c, path_t *pt, uint64_t seq, int64_t t1, uint8_t size, uint8_t confirm) {
    out_t *o = &pt->out[seq % OUT_SLOTS];
    if (o->waiting) emit_miss(c, pt, o); /* OUT_SLOTS requests later and still unanswered */
    o->seq = seq; o->t_sent = t1; o->deadline = t1 + pt->rto_ns; o->size = size; o->waiting = 1;
    o->confirm = confirm;
}

/* a reply in judging mode: fold it into ANSWERED if on time, else a LATE event */
static void track_reply(Core *c, path_t *pt, const probe_t *p, int64_t t_rx) {
    expire(c, pt, t_rx); /* requests whose deadline passed before this reply came are missed */
    out_t *o = &pt->out[p->seq % OUT_SLOTS];
    if (o->waiting && o->seq == p->seq && t_rx <= o->deadline) {
        o->waiting = 0;
        ev_t *a = &pt->agg;
        a->kind = EV_ANSWERED; a->path_id = pt->path_id; a->count++;
        int64_t rtt = t_rx - p->t1; /* the batch's worst round trip: the timeout must cover it */
        if (rtt > 0 && (uint64_t)rtt > a->worst_rtt) a->worst_rtt = rtt > UINT32_MAX ? UINT32_MAX : (uint32_t)rtt;
        if (p->seq >= a->seq || a->count == 1) {
            a->seq = p->seq; a->rx_count = p->rx_count;
            a->t1 = p->t1; a->t2 = p->t2; a->t3 = p->t3; a->t4 = t_rx;
        }
        a->size |= o->size;
        pt->misses_in_row = 0;
        if (o->confirm) flush_answered(c, pt); /* the evidence a DOWN waits for: to Python now */
        return;
    }
    if (o->waiting && o->seq == p->seq) emit_miss(c, pt, o); /* late: judged before it is heard */
    pt->misses_in_row = 0; /* any reply, a late one too, ends the detector's streak */
    flush_answered(c, pt);
    ev_t *e = ev_push(c);
    if (e) {
        e->kind = EV_LATE; e->path_id = pt->path_id; e->seq = p->seq; e->rx_count = p->rx_count;
        e->t1 = p->t1; e->t2 = p->t2; e->t3 = p->t3; e->t4 = t_rx;
    }
}

/* a request has gone out (sendmmsg took it): counted, and awaited while judging */
static void request_sent(Core *c, path_t *pt, uint64_t seq, int64_t t1, uint8_t size, uint8_t confirm) {
    pt->sent++;
    c->sent++;
    if (c->tracking) track_sent(c, pt, seq, t1, size, confirm);
}

/* sends the batch; touches nothing shared, so the probe thread calls it without `mu`: the
 * kernel forwards what it sends through a software fabric within the call (hundreds of µs for
 * a burst on the testbed), and Python's take_events must not wait for that */
static void tx_send(Core *c, int nic, txbatch_t *b) {
    int off = 0;
    while (off < b->n) {
        int r = sendmmsg(c->nics[nic].tx_fd, b->msgs + off, b->n - off, MSG_DONTWAIT);
        if (r < 0) { /* drop the packet at the head and go on: never wait on a peer */
            b->err[off++] = (int8_t)((errno == EAGAIN || errno == ENOBUFS) ? D_SEND_FULL : D_SEND_ERROR);
            continue;
        }
        for (int i = off; i < off + r; i++) b->err[i] = -1;
        off += r;
    }
}

static int path_index(Core *c, uint32_t path_id);

/* under `mu`, after tx_send: counts the batch, and awaits its requests. A path added or removed
 * in between may have moved: its requests are found by id, and a new path with an old one's id
 * (its sequence numbers start above the old one's) does not take the old one's requests */
static void tx_account(Core *c, txbatch_t *b) {
    for (int i = 0; i < b->n; i++) {
        if (b->err[i] >= 0) { c->rx.drops[b->err[i]]++; continue; }
        if (b->what[i] < 0) { c->reflected++; continue; }
        int pi = b->gen == c->paths_gen ? b->what[i] : path_index(c, b->pid[i]);
        if (pi < 0) continue;
        path_t *pt = &c->paths[pi];
        if (b->seq[i] < pt->first_seq || b->seq[i] >= pt->next_seq) continue;
        request_sent(c, pt, b->seq[i], b->t1[i], b->size_probe[i], b->confirm[i]);
    }
    b->n = 0;
}

/* a full batch, mid-work under `mu` */
static void tx_flush(Core *c, int nic, txbatch_t *b) {
    tx_send(c, nic, b);
    tx_account(c, b);
}

/* the probe thread's batches, with `mu` released while they are sent */
static void tx_flush_unlocked(Core *c, txbatch_t *tx) {
    int any = 0;
    for (int nic = 0; nic < c->nnics; nic++)
        if (tx[nic].n) { tx_send(c, nic, &tx[nic]); any = 1; }
    if (!any) return;
    pthread_mutex_lock(&c->mu);
    for (int nic = 0; nic < c->nnics; nic++)
        if (tx[nic].n) tx_account(c, &tx[nic]);
    pthread_mutex_unlock(&c->mu);
}

static uint8_t *tx_slot(txbatch_t *b, const uint8_t dst[4], int what) {
    int i = b->n++;
    b->what[i] = what;
    memset(&b->to[i], 0, sizeof b->to[i]);
    b->to[i].sin_family = AF_INET;
    memcpy(&b->to[i].sin_addr, dst, 4);
    b->iov[i].iov_base = b->buf + (size_t)i * MAX_PKT;
    memset(&b->msgs[i], 0, sizeof b->msgs[i]);
    b->msgs[i].msg_hdr.msg_name = &b->to[i];
    b->msgs[i].msg_hdr.msg_namelen = sizeof b->to[i];
    b->msgs[i].msg_hdr.msg_iov = &b->iov[i];
    b->msgs[i].msg_hdr.msg_iovlen = 1;
    return b->buf + (size_t)i * MAX_PKT;
}

static int path_index(Core *c, uint32_t path_id) {
    for (int i = 0; i < c->npaths; i++) /* few hundred paths: a scan is cheaper than a hash here */
        if (c->paths[i].path_id == path_id) return i;
    return -1;
}

static int64_t stamp_now(void *ctx) { return local_clock((Core *)ctx, now_ns(CLOCK_REALTIME)); }

/* an authenticated reply from `src`, received at t_rx (local clock): matched to the path that sent
 * its request, then judged (tracking) or handed over as an exchange; dropped and counted if it
 * is not a reply to a request of that path, or was taken before */
static void take_reply(Core *c, const probe_t *p, const uint8_t src[4], int64_t t_rx) {
    int pi = (p->sender == c->agent_id) ? path_index(c, p->path) : -1;
    if (pi < 0 || memcmp(c->paths[pi].peer, src, 4) != 0) { c->rx.drops[D_UNEXPECTED]++; return; }
    path_t *pt = &c->paths[pi];
    /* a reply to a request this path never sent: an earlier path with the same id, or forged */
    if (p->seq < pt->first_seq || p->seq >= pt->next_seq) { c->rx.drops[D_UNEXPECTED]++; return; }
    if (!replay_accept(&pt->replay, p->seq)) { c->rx.drops[D_REPLAY]++; return; }
    c->replies++;
    if (c->tracking) { track_reply(c, pt, p, t_rx); return; }
    if (c->ring_len == c->ring_cap) { c->rx.drops[D_RING_FULL]++; return; }
    xrec_t *x = &c->ring[(c->ring_head + c->ring_len++) % c->ring_cap];
    x->path_id = p->path; x->rx_count = p->rx_count; x->seq = p->seq;
    x->t1 = p->t1; x->t2 = p->t2; x->t3 = p->t3; x->t4 = t_rx;
}

/* one received packet: the receive path (probe_rx.h) drops it, reflects it into the NIC's send
 * batch, or hands over an authenticated reply, matched here to the path that sent its request */
static void handle_packet(Core *c, int nic, const uint8_t *data, size_t n, const struct sockaddr_in *from,
                          int64_t t_rx_true, int64_t now_mono, txbatch_t *tx) {
    probe_t p;
    const uint8_t *src = (const uint8_t *)&from->sin_addr;
    uint16_t sport = ntohs(from->sin_port);
    int64_t t_rx = local_clock(c, t_rx_true);
    if (tx->n == BATCH) tx_flush(c, nic, tx); /* room for a reply in the next slot */
    size_t len = 0;
    int what = rx_handle(&c->rx, data, n, src, c->nics[nic].addr, sport, now_mono, t_rx, stamp_now, c, &p,
                         tx->buf + (size_t)tx->n * MAX_PKT, &len);
    if (what == RX_REFLECTED) {
        tx_slot(tx, src, -1);
        tx->iov[tx->n - 1].iov_len = len;
        return;
    }
    if (what != RX_REPLY) return; /* dropped, and counted */
    take_reply(c, &p, src, t_rx);
}

static void queue_probe(Core *c, int nic, int i, txbatch_t *tx, uint8_t confirm) {
    path_t *pt = &c->paths[i];
    if (tx[nic].n == BATCH) tx_flush(c, nic, &tx[nic]);
    probe_t p = {0};
    int size_probe = pt->size_every && ++pt->size_count % pt->size_every == 0;
    p.kind = KIND_REQUEST; p.pad = size_probe ? pt->size_pad : pt->pad; p.flags = p.pad ? 1 : 0;
    p.sender = c->agent_id; p.reflector = pt->peer_id; p.path = pt->path_id; p.seq = pt->next_seq++;
    p.t1 = local_clock(c, now_ns(CLOCK_REALTIME));
    uint8_t *pkt = tx_slot(&tx[nic], pt->peer, i);
    tx[nic].seq[tx[nic].n - 1] = p.seq;
    tx[nic].t1[tx[nic].n - 1] = p.t1;
    tx[nic].size_probe[tx[nic].n - 1] = (uint8_t)size_probe;
    tx[nic].confirm[tx[nic].n - 1] = confirm;
    tx[nic].pid[tx[nic].n - 1] = pt->path_id;
    tx[nic].gen = c->paths_gen;
    size_t len = encode(&c->rx.keyed, &p, c->nics[nic].addr, pt->peer, pt->sport, ROCE_PORT, pkt + IP_UDP_LEN);
    build_ip_udp(pkt, c->nics[nic].addr, pt->peer, pt->sport, len);
    tx[nic].iov[tx[nic].n - 1].iov_len = IP_UDP_LEN + len;
}

/* whether a probe is due now: only then may slower paths' probes go early (EARLY_SHARE) */
static int any_due(const Core *c, int64_t now_mono) {
    for (int i = 0; i < c->npaths; i++) {
        const path_t *pt = &c->paths[i];
        if (pt->next_due <= now_mono + COALESCE_NS || (pt->pair_due && pt->pair_due <= now_mono)
            || (pt->confirm_due[0] && pt->confirm_due[0] <= now_mono)
            || (pt->confirm_due[1] && pt->confirm_due[1] <= now_mono))
            return 1;
    }
    return 0;
}

static void send_due(Core *c, int64_t now_mono, txbatch_t *tx) {
    /* a wake-up for a reply or a lane look sends nothing early: each send is followed by its
     * replies' wake-up, so probes pulled into every such wake-up split one burst into many */
    if (!any_due(c, now_mono)) return;
    for (int nic = 0; nic < c->nnics; nic++) {
        for (int i = 0; i < c->npaths; i++) {
            path_t *pt = &c->paths[i];
            if (pt->nic != nic) continue;
            if (pt->pair_due && pt->pair_due <= now_mono) { /* second probe of a coded pair */
                queue_probe(c, nic, i, tx, 0);
                pt->pair_due = 0;
            }
            int conf = 0; /* a confirmation round's probe, besides the schedule (one for both kinds) */
            for (int k = 0; k < 2; k++)
                if (pt->confirm_due[k] && pt->confirm_due[k] <= now_mono) { conf = 1; pt->confirm_due[k] = 0; }
            if (conf) {
                queue_probe(c, nic, i, tx, 1);
                continue;
            }
            int64_t early = pt->interval_ns / EARLY_SHARE;
            if (pt->next_due > now_mono + (early > COALESCE_NS ? early : COALESCE_NS)) continue;
            queue_probe(c, nic, i, tx, 0);
            /* the pair's second probe goes out `gap` later, alone: on a software fabric a
             * back-to-back pair is spread by the first packet's own forwarding work */
            if (pt->pair_gap_ns) pt->pair_due = now_mono + pt->pair_gap_ns;
            /* next due: interval +- jitter, never in the past (a late loop does not burst) */
            int64_t j = 0;
            if (c->jitter_ppm) {
                int64_t span = pt->interval_ns * c->jitter_ppm / 1000000;
                if (span > 0) j = (int64_t)(rng_next(c) % (uint64_t)(2 * span + 1)) - span;
            }
            pt->next_due += pt->interval_ns + j;
            if (pt->next_due < now_mono) pt->next_due = now_mono + pt->interval_ns / 2;
        }
    }
    /* the caller sends the batches once `mu` is released (tx_flush_unlocked) */
}

/* one look at the watched lane reports (under lane_mu); returns whether the digest changed.
 * pread cannot fault on a file its writer truncates, as a mapping would; a report that cannot be
 * read digests as one that is not a report, a gone writer's (heartbeat over LW_STALE_NS old) as
 * one without lanes, read no further than its header */
static int lane_look(Core *c, int64_t now) {
    uint64_t h = lw_mix(0, (uint64_t)c->nlanes);
    long budget = LW_LOOK_BYTES;
    int first = c->nlanes ? c->lane_first % c->nlanes : 0, next_first = -1;
    for (int k = 0; k < c->nlanes; k++) {
        int i = (first + k) % c->nlanes;
        ssize_t n = pread(c->lane_fds[i], c->lane_buf, LW_HEADER, 0);
        size_t len = n > 0 ? (size_t)n : 0;
        long want = lw_lanes_wanted(c->lane_buf, len);
        if (want > 0 && lw_gone(c->lane_buf, now)) {
            c->lane_h[i] = LW_GONE;
            continue;
        }
        if (want > budget && budget < LW_LOOK_BYTES) { /* no room in this look: its last digest stands */
            c->lane_deferred++;
            if (next_first < 0) next_first = i;
            continue;
        }
        if (want > 0) {
            budget -= want;
            ssize_t m = pread(c->lane_fds[i], c->lane_buf + LW_HEADER, (size_t)want, LW_HEADER);
            if (m > 0) len += (size_t)m;
        }
        c->lane_h[i] = lw_digest(c->lane_buf, len, now, c->lane_window_ns, c->lane_silent_ns);
    }
    for (int i = 0; i < c->nlanes; i++) h = lw_mix(h, c->lane_h[i]);
    c->lane_first = next_first < 0 ? 0 : next_first;
    c->lane_looks++;
    c->lane_next = now + c->lane_window_ns / 2;
    if (h == c->lane_digest) return 0;
    c->lane_digest = h;
    c->lane_changed = 1;
    c->lane_changes++;
    return 1;
}

/* wakes the loop from ppoll: a path added, a shorter interval, a stop */
static void wake_loop(Core *c) {
    uint64_t one = 1;
    if (c->wfd >= 0 && write(c->wfd, &one, sizeof one) < 0) { /* full counter: the loop wakes anyway */ }
}

static void signal_python(Core *c) {
    if (!c->notify) return;
    c->notify = 0;
    uint64_t one = 1;
    if (c->efd >= 0 && write(c->efd, &one, sizeof one) < 0) { /* full counter: Python is awake anyway */ }
}

static void set_evidence(Core *c, int64_t t) {
    c->evidence_local = t;
    c->evidence_updates++;
    if (c->tracking)
        for (int i = 0; i < c->npaths; i++) expire(c, &c->paths[i], t);
}

/* the loop: returns after duration_ns (CLOCK_MONOTONIC) */
static void core_run(Core *c, int64_t duration_ns, txbatch_t *tx, uint8_t *rxbuf) {
    struct pollfd pfd[MAX_NICS + 1];
    const int npoll = c->nnics; /* NICs are added before the loop runs, never while */
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in from[BATCH];
    char cbuf[BATCH][64];
    for (int i = 0; i < npoll; i++) { pfd[i].fd = c->nics[i].rx_fd; pfd[i].events = POLLIN; }
    pfd[npoll].fd = c->wfd; pfd[npoll].events = POLLIN; pfd[npoll].revents = 0;
    int64_t end = now_ns(CLOCK_MONOTONIC) + duration_ns;
    for (;;) {
        int64_t now = now_ns(CLOCK_MONOTONIC);
        if (now >= end || c->thread_stop) break;
        int64_t next = end;
        int lanes_changed = 0;
        pthread_mutex_lock(&c->lane_mu);
        if (c->nlanes) {
            /* up to a quarter window early when the loop is awake anyway: a look of its own is a
             * wake-up of its own, which costs the thread more than the look */
            if (now >= c->lane_next - c->lane_window_ns / 4) lanes_changed = lane_look(c, now);
            if (c->lane_next < next) next = c->lane_next;
        }
        pthread_mutex_unlock(&c->lane_mu);
        pthread_mutex_lock(&c->mu);
        if (lanes_changed) {
            c->notify = 1;
            signal_python(c);
        }
        send_due(c, now, tx);
        rx_sweep(&c->rx, now, SWEEP_SLOTS);
        int64_t mono_minus_local = c->tracking ? now - local_clock(c, now_ns(CLOCK_REALTIME)) : 0;
        for (int i = 0; i < c->npaths; i++) {
            path_t *pt = &c->paths[i];
            if (pt->next_due < next) next = pt->next_due;
            if (pt->pair_due && pt->pair_due < next) next = pt->pair_due;
            for (int k = 0; k < 2; k++)
                if (pt->confirm_due[k] && pt->confirm_due[k] < next) next = pt->confirm_due[k];
            if (c->tracking && pt->exp_seq < pt->next_seq) { /* judge a miss the moment it is due */
                out_t *o = &pt->out[pt->exp_seq % OUT_SLOTS];
                if (o->waiting && o->seq == pt->exp_seq && o->deadline + mono_minus_local < next)
                    next = o->deadline + mono_minus_local + 1;
            }
        }
        pthread_mutex_unlock(&c->mu);
        tx_flush_unlocked(c, tx);
        int64_t wait = next - now_ns(CLOCK_MONOTONIC);
        if (wait > MAX_SLEEP_NS) wait = MAX_SLEEP_NS;
        struct timespec ts = {0, 0};
        if (wait > 0) { ts.tv_sec = wait / 1000000000LL; ts.tv_nsec = wait % 1000000000LL; }
        int ready = ppoll(pfd, npoll + 1, &ts, NULL);
        if (ready < 0) continue;
        if (pfd[npoll].revents & POLLIN) { /* woken by Python: no packet, so it is not counted */
            uint64_t n;
            if (read(c->wfd, &n, sizeof n) < 0) { /* already read: nothing to clear */ }
            ready--;
        }
        int64_t t_check = now_ns(CLOCK_REALTIME);
        c->wakeups++;
        if (ready == 0) { /* nothing arrived while we slept: everything before now is known */
            pthread_mutex_lock(&c->mu);
            set_evidence(c, local_clock(c, t_check));
            signal_python(c);
            pthread_mutex_unlock(&c->mu);
            continue;
        }
        /* every NIC is read until empty (a no-op recvmmsg on a quiet one) so that, if all come
         * back empty, everything that arrived before t_check is known: the evidence time */
        int all_emptied = 1;
        for (int nic = 0; nic < c->nnics; nic++) {
            int emptied = 0;
            for (int round = 0; round < 4; round++) { /* bounded work per wake-up */
                for (int i = 0; i < BATCH; i++) {
                    iov[i].iov_base = rxbuf + (size_t)i * MAX_PKT;
                    iov[i].iov_len = MAX_PKT;
                    memset(&msgs[i].msg_hdr, 0, sizeof msgs[i].msg_hdr);
                    msgs[i].msg_hdr.msg_name = &from[i];
                    msgs[i].msg_hdr.msg_namelen = sizeof from[i];
                    msgs[i].msg_hdr.msg_iov = &iov[i];
                    msgs[i].msg_hdr.msg_iovlen = 1;
                    msgs[i].msg_hdr.msg_control = cbuf[i];
                    msgs[i].msg_hdr.msg_controllen = sizeof cbuf[i];
                }
                int got = recvmmsg(c->nics[nic].rx_fd, msgs, BATCH, MSG_DONTWAIT, NULL);
                if (got <= 0) { emptied = got == 0 || errno == EAGAIN || errno == EWOULDBLOCK; break; }
                int64_t fallback = now_ns(CLOCK_REALTIME), mono = now_ns(CLOCK_MONOTONIC);
                pthread_mutex_lock(&c->mu);
                for (int i = 0; i < got; i++) {
                    int64_t t_rx = fallback;
                    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msgs[i].msg_hdr); cm; cm = CMSG_NXTHDR(&msgs[i].msg_hdr, cm)) {
                        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SO_TIMESTAMPNS) {
                            struct timespec k;
                            memcpy(&k, CMSG_DATA(cm), sizeof k);
                            t_rx = (int64_t)k.tv_sec * 1000000000LL + k.tv_nsec;
                        }
                    }
                    c->received++;
                    handle_packet(c, nic, rxbuf + (size_t)i * MAX_PKT, msgs[i].msg_len, &from[i], t_rx, mono,
                                  &tx[nic]);
                }
                /* what this round made Python wait for (a round's answers, a late reply) goes to
                 * it before the round's reflections are sent */
                signal_python(c);
                pthread_mutex_unlock(&c->mu);
                tx_flush_unlocked(c, tx);
                if (got < BATCH) { emptied = 1; break; }
            }
            all_emptied &= emptied;
        }
        pthread_mutex_lock(&c->mu);
        if (all_emptied) set_evidence(c, local_clock(c, t_check));
        signal_python(c);
        pthread_mutex_unlock(&c->mu);
    }
}

static void *core_thread(void *arg) {
    Core *c = arg;
    pthread_setname_np(pthread_self(), "lp-probe"); /* what top -H and /proc/<pid>/task show */
    /* real-time priority: on a busy host a normal thread waits for a CPU for milliseconds, and a
     * reflector that answers late looks like a lossy link to its peers. The loop sleeps in ppoll
     * between packets, so it takes little CPU; the kernel's RT throttling bounds it anyway. */
    if (c->rt_priority > 0) {
        struct sched_param sp = {.sched_priority = c->rt_priority};
        c->rt_status = pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp);
    }

    while (!c->thread_stop) core_run(c, 100000000LL, c->bg_tx, c->bg_rx);
    return NULL;
}

/* ---- Python type ------------------------------------------------------------------------ */
/* Before __init__ runs (or when it failed) the object owns nothing: no fd (efd = -1, never 0,
 * so a failed constructor closes no descriptor it did not open), no memory, and `ready` = 0,
 * which every method checks. */
static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Core *self = (Core *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->efd = self->wfd = -1;
    pthread_mutex_init(&self->mu, NULL);
    pthread_mutex_init(&self->lane_mu, NULL);
    return (PyObject *)self;
}

#define NEED_READY(self)                                                                         \
    do {                                                                                         \
        if (!(self)->ready) return PyErr_Format(PyExc_RuntimeError, "Core is not initialised"); \
    } while (0)

static int Core_init(Core *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"key", "agent_id", "ring", "seed", "jitter_ppm", "accept_key", NULL};
    Py_buffer key, other = {0};
    unsigned int agent_id, ring = XRING_DEFAULT, jitter = 100000;
    unsigned long long seed = 1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Core is initialised once; make a new one");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*I|IKIy*", kwlist, &key, &agent_id, &ring, &seed, &jitter, &other))
        return -1;
    if (key.len < FLEET_KEY_MIN || key.len > FLEET_KEY_MAX ||
        (other.buf && other.len && (other.len < FLEET_KEY_MIN || other.len > FLEET_KEY_MAX))) {
        PyBuffer_Release(&key);
        if (other.buf) PyBuffer_Release(&other);
        PyErr_Format(PyExc_ValueError, "fleet key must be %d..%d bytes", FLEET_KEY_MIN, FLEET_KEY_MAX);
        return -1;
    }
    if (agent_id == 0 || ring < 16 || jitter >= 1000000) {
        PyBuffer_Release(&key);
        if (other.buf) PyBuffer_Release(&other);
        PyErr_SetString(PyExc_ValueError, "agent_id must be > 0, ring >= 16, jitter_ppm < 1000000");
        return -1;
    }
    path_t *paths = PyMem_Calloc(MAX_PATHS, sizeof(path_t));
    reflect_t *reflect = PyMem_Calloc(REFLECT_SLOTS, sizeof(reflect_t));
    xrec_t *xring = PyMem_Calloc(ring, sizeof(xrec_t));
    ev_t *evring = PyMem_Calloc(ring, sizeof(ev_t));
    int efd = -1, wfd = -1;
    if (paths && reflect && xring && evring) {
        efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        wfd = efd < 0 ? -1 : eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (wfd < 0) PyErr_SetFromErrno(PyExc_OSError);
    } else {
        PyErr_NoMemory();
    }
    if (wfd < 0) { /* nothing was kept: release what this call took, and only that */
        if (efd >= 0) close(efd);
        PyBuffer_Release(&key);
        if (other.buf) PyBuffer_Release(&other);
        PyMem_Free(paths); PyMem_Free(reflect); PyMem_Free(xring); PyMem_Free(evring);
        return -1;
    }
    rx_init(&self->rx, key.buf, (size_t)key.len, agent_id, reflect, seed);
    if (other.buf && other.len) rx_set_keys(&self->rx, key.buf, (size_t)key.len, other.buf, (size_t)other.len);
    PyBuffer_Release(&key);
    if (other.buf) PyBuffer_Release(&other);
    self->agent_id = agent_id;
    self->paths = paths;
    self->ring = xring;
    self->evring = evring;
    self->efd = efd;
    self->wfd = wfd;
    self->ring_cap = ring;
    self->rng = seed ? seed : 1;
    self->jitter_ppm = jitter;
    self->ready = 1;
    return 0;
}

static void stop_thread(Core *self) {
    if (!self->thread_running) return;
    self->thread_stop = 1;
    wake_loop(self);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->thread_running = 0;
    for (int i = 0; i < self->nnics; i++) free(self->bg_tx[i].buf);
    free(self->bg_tx);
    free(self->bg_rx);
    self->bg_tx = NULL;
    self->bg_rx = NULL;
}

static void Core_dealloc(Core *self) {
    stop_thread(self);
    for (int i = 0; i < self->nlanes; i++) close(self->lane_fds[i]);
    PyMem_Free(self->lane_buf);
    for (int i = 0; self->paths && i < self->npaths; i++) PyMem_Free(self->paths[i].out);
    PyMem_Free(self->paths);
    PyMem_Free(self->rx.reflect);
    PyMem_Free(self->ring);
    PyMem_Free(self->evring);
    if (self->efd >= 0) close(self->efd);
    if (self->wfd >= 0) close(self->wfd);
    pthread_mutex_destroy(&self->mu);
    pthread_mutex_destroy(&self->lane_mu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int get_addr(PyObject *obj, uint8_t out[4]) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_SIMPLE) < 0) return -1;
    int ok = b.len == 4;
    if (ok) memcpy(out, b.buf, 4);
    PyBuffer_Release(&b);
    if (!ok) PyErr_SetString(PyExc_ValueError, "address must be 4 bytes (socket.inet_aton)");
    return ok ? 0 : -1;
}

static PyObject *Core_add_nic(Core *self, PyObject *args) {
    NEED_READY(self);
    int rx, tx;
    PyObject *addr;
    if (!PyArg_ParseTuple(args, "iiO", &rx, &tx, &addr)) return NULL;
    /* the running loop sized its send batches and poll set by the NICs it started with */
    if (self->thread_running) return PyErr_Format(PyExc_RuntimeError, "add NICs before start()");
    if (self->nnics == MAX_NICS) return PyErr_Format(PyExc_ValueError, "at most %d NICs", MAX_NICS);
    if (rx < 0 || tx < 0) return PyErr_Format(PyExc_ValueError, "rx_fd and tx_fd must be open descriptors, got %d, %d", rx, tx);
    nic_t *n = &self->nics[self->nnics];
    if (get_addr(addr, n->addr) < 0) return NULL;
    n->rx_fd = rx; n->tx_fd = tx;
    return PyLong_FromLong(self->nnics++);
}

/* the paddings the receive path lets through to the hash: the small probe, every path's own and
 * full-size padding (their replies come back as long), and what the agent declared (the sizes
 * its peers probe it with). Called under `mu` after each change. */
static void update_pads(Core *c) {
    memset(c->rx.pad_ok, 0, sizeof c->rx.pad_ok);
    c->rx.pad_ok[0] = 1;
    for (int i = 0; i < c->npaths; i++) {
        c->rx.pad_ok[c->paths[i].pad] = 1;
        if (c->paths[i].size_every) c->rx.pad_ok[c->paths[i].size_pad] = 1;
    }
    for (int i = 0; i < c->ndeclared; i++) c->rx.pad_ok[c->declared[i]] = 1;
}

static PyObject *Core_add_path(Core *self, PyObject *args) {
    NEED_READY(self);
    unsigned int path_id, peer_id;
    int nic, sport, pad;
    long long interval, first_due, pair_gap = 0;
    PyObject *peer;
    if (!PyArg_ParseTuple(args, "IiIOiLiL|L", &path_id, &nic, &peer_id, &peer, &sport, &interval, &pad, &first_due,
                          &pair_gap))
        return NULL;
    if (nic < 0 || nic >= self->nnics) return PyErr_Format(PyExc_ValueError, "unknown NIC index %d", nic);
    if (sport < 1 || sport > 65535 || interval < 10000 || pad < 0 || pad > MAX_PAD || pair_gap < 0 ||
        pair_gap >= interval)
        return PyErr_Format(PyExc_ValueError, "sport 1..65535, interval >= 10 us, pad 0..%d, 0 <= pair gap < interval",
                            MAX_PAD);
    path_t np;
    memset(&np, 0, sizeof np);
    if (get_addr(peer, np.peer) < 0) return NULL;
    np.path_id = path_id; np.peer_id = peer_id; np.nic = nic; np.sport = (uint16_t)sport; np.pad = (uint16_t)pad;
    np.interval_ns = interval; np.next_due = first_due; np.pair_gap_ns = pair_gap;
    np.rto_ns = 5000000; /* until the detector pushes one: its initial timeout */
    np.out = PyMem_Calloc(OUT_SLOTS, sizeof(out_t));
    if (!np.out) return PyErr_NoMemory();
    pthread_mutex_lock(&self->mu);
    int exists = path_index(self, path_id) >= 0, full = self->npaths == MAX_PATHS;
    if (!exists && !full) {
        uint64_t base = (uint64_t)now_ns(CLOCK_REALTIME) & ~1ULL; /* even: a coded pair starts on an even seq */
        np.first_seq = np.next_seq = np.exp_seq = base > self->seq_floor ? base : self->seq_floor;
        self->paths[self->npaths++] = np;
        self->paths_gen++;
        update_pads(self);
    }
    pthread_mutex_unlock(&self->mu);
    if (!exists && !full) wake_loop(self);
    if (exists || full) PyMem_Free(np.out);
    if (exists) return PyErr_Format(PyExc_ValueError, "path %u exists", path_id);
    if (full) return PyErr_Format(PyExc_ValueError, "at most %d paths", MAX_PATHS);
    Py_RETURN_NONE;
}

/* events judged for a path that is being removed, not yet taken: they are about a path gone, and
 * a path added later under the same id must not be handed them */
static void drop_events_of(Core *c, uint32_t path_id) {
    uint32_t kept = 0;
    for (uint32_t i = 0; i < c->ev_len; i++) {
        const ev_t *e = &c->evring[(c->ev_head + i) % c->ring_cap];
        if (e->path_id != path_id) c->evring[(c->ev_head + kept++) % c->ring_cap] = *e;
    }
    c->ev_len = kept;
}

static PyObject *Core_remove_path(Core *self, PyObject *args) {
    NEED_READY(self);
    unsigned int path_id;
    if (!PyArg_ParseTuple(args, "I", &path_id)) return NULL;
    pthread_mutex_lock(&self->mu);
    int i = path_index(self, path_id);
    out_t *gone = NULL;
    if (i >= 0) {
        gone = self->paths[i].out;
        uint64_t after = (self->paths[i].next_seq + 1) & ~1ULL;
        if (after > self->seq_floor) self->seq_floor = after;
        drop_events_of(self, path_id);
        self->paths[i] = self->paths[--self->npaths];
        self->paths_gen++;
        update_pads(self);
    }
    pthread_mutex_unlock(&self->mu);
    PyMem_Free(gone);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    Py_RETURN_NONE;
}

static PyObject *Core_set_interval(Core *self, PyObject *args) {
    NEED_READY(self);
    unsigned int path_id;
    long long interval;
    if (!PyArg_ParseTuple(args, "IL", &path_id, &interval)) return NULL;
    pthread_mutex_lock(&self->mu);
    int i = path_index(self, path_id), bad = 0, sooner = 0;
    if (i >= 0) {
        path_t *p = &self->paths[i];
        if (interval < 10000 || p->pair_gap_ns >= interval) bad = 1;
        else {
            /* an active path must not wait out the rest of a long idle interval */
            if ((sooner = interval < p->interval_ns)) p->next_due -= p->interval_ns - interval;
            p->interval_ns = interval;
        }
    }
    pthread_mutex_unlock(&self->mu);
    if (sooner) wake_loop(self);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    if (bad) return PyErr_Format(PyExc_ValueError, "interval must be >= 10 us and longer than the pair gap");
    Py_RETURN_NONE;
}

static PyObject *Core_watch_lanes(Core *self, PyObject *args) {
    NEED_READY(self);
    PyObject *seq;
    long long window, silent;
    if (!PyArg_ParseTuple(args, "OLL", &seq, &window, &silent)) return NULL;
    if (window < 100000 || silent < window)
        return PyErr_Format(PyExc_ValueError, "window must be >= 100 us and silent_ns >= window");
    PyObject *fast = PySequence_Fast(seq, "watch_lanes takes a sequence of file descriptors");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_LANE_REPORTS) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "at most %d lane reports", MAX_LANE_REPORTS);
    }
    if (!self->lane_buf && !(self->lane_buf = PyMem_Malloc(LW_MAX_BYTES))) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    int fds[MAX_LANE_REPORTS], made = 0;
    for (; made < n; made++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, made));
        if (fd < 0 && PyErr_Occurred()) break;
        if (fd < 0 || fd > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%ld is not a file descriptor", fd);
            break;
        }
        if ((fds[made] = fcntl((int)fd, F_DUPFD_CLOEXEC, 0)) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            break;
        }
    }
    Py_DECREF(fast);
    if (made < n) {
        for (int i = 0; i < made; i++) close(fds[i]);
        return NULL;
    }
    int old[MAX_LANE_REPORTS], nold;
    pthread_mutex_lock(&self->lane_mu);
    nold = self->nlanes;
    memcpy(old, self->lane_fds, sizeof(int) * (size_t)nold);
    memcpy(self->lane_fds, fds, sizeof(int) * (size_t)n);
    memset(self->lane_h, 0, sizeof self->lane_h);
    self->nlanes = (int)n;
    self->lane_first = 0;
    self->lane_window_ns = window;
    self->lane_silent_ns = silent;
    self->lane_next = 0; /* at once: the first look tells Python what it sees */
    pthread_mutex_unlock(&self->lane_mu);
    for (int i = 0; i < nold; i++) close(old[i]);
    wake_loop(self);
    Py_RETURN_NONE;
}

static PyObject *Core_lanes_changed(Core *self, PyObject *Py_UNUSED(ignored)) {
    NEED_READY(self);
    pthread_mutex_lock(&self->lane_mu);
    int changed = self->lane_changed;
    self->lane_changed = 0;
    pthread_mutex_unlock(&self->lane_mu);
    return PyBool_FromLong(changed);
}

static PyObject *Core_lane_digest(Core *self, PyObject *args) {
    Py_buffer b;
    long long now, window, silent;
    if (!PyArg_ParseTuple(args, "y*LLL", &b, &now, &window, &silent)) return NULL;
    uint64_t h = lw_digest(b.buf, (size_t)b.len, now, window, silent);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *Core_set_clock(Core *self, PyObject *args) {
    NEED_READY(self);
    long long bt, bl, rate;
    if (!PyArg_ParseTuple(args, "LLL", &bt, &bl, &rate)) return NULL;
    pthread_mutex_lock(&self->mu);
    self->clk_base_true = bt; self->clk_base_local = bl; self->clk_rate_ppb = rate;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Core_run(Core *self, PyObject *args) {
    NEED_READY(self);
    long long duration;
    if (!PyArg_ParseTuple(args, "L", &duration)) return NULL;
    if (self->thread_running) return PyErr_Format(PyExc_RuntimeError, "the loop runs in the background; stop() it first");
    txbatch_t *tx = PyMem_Calloc(self->nnics ? self->nnics : 1, sizeof(txbatch_t));
    uint8_t *rxbuf = PyMem_Malloc((size_t)BATCH * MAX_PKT);
    int ok = tx && rxbuf;
    for (int i = 0; ok && i < self->nnics; i++) {
        tx[i].buf = PyMem_Malloc((size_t)BATCH * MAX_PKT);
        ok = tx[i].buf != NULL;
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        core_run(self, duration, tx, rxbuf);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; tx && i < self->nnics; i++) PyMem_Free(tx[i].buf);
    PyMem_Free(tx);
    PyMem_Free(rxbuf);
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Core_start(Core *self, PyObject *args) {
    NEED_READY(self);
    int prio = 0;
    if (!PyArg_ParseTuple(args, "|i", &prio)) return NULL;
    if (prio < 0 || prio > 99) return PyErr_Format(PyExc_ValueError, "rt priority must be 0 (off) .. 99");
    if (self->thread_running) Py_RETURN_NONE;
    self->rt_priority = prio;
    self->rt_status = 0;
    self->bg_tx = calloc(self->nnics ? self->nnics : 1, sizeof(txbatch_t));
    self->bg_rx = malloc((size_t)BATCH * MAX_PKT);
    int ok = self->bg_tx && self->bg_rx;
    for (int i = 0; ok && i < self->nnics; i++) ok = (self->bg_tx[i].buf = malloc((size_t)BATCH * MAX_PKT)) != NULL;
    self->thread_stop = 0;
    if (!ok || pthread_create(&self->thread, NULL, core_thread, self) != 0) {
        for (int i = 0; self->bg_tx && i < self->nnics; i++) free(self->bg_tx[i].buf);
        free(self->bg_tx);
        free(self->bg_rx);
        self->bg_tx = NULL;
        self->bg_rx = NULL;
        return ok ? PyErr_Format(PyExc_OSError, "cannot start the probe thread") : PyErr_NoMemory();
    }
    self->thread_running = 1;
    Py_RETURN_NONE;
}

static PyObject *Core_rt_status(Core *self, PyObject *Py_UNUSED(ignored)) {
    NEED_READY(self);
    return PyLong_FromLong(self->rt_status);
}

static PyObject *Core_stop(Core *self, PyObject *Py_UNUSED(ignored)) {
    NEED_READY(self);
    stop_thread(self);
    Py_RETURN_NONE;
}

static PyObject *Core_take(Core *self, PyObject *Py_UNUSED(ignored)) {
    NEED_READY(self);
    /* completed exchanges since the last call, as packed little-endian records "<IIQqqqq" */
    pthread_mutex_lock(&self->mu);
    uint32_t n = self->ring_len;
    char *tmp = n ? malloc((size_t)n * sizeof(xrec_t)) : NULL;
    if (tmp) {
        for (uint32_t i = 0; i < n; i++)
            memcpy(tmp + (size_t)i * sizeof(xrec_t), &self->ring[(self->ring_head + i) % self->ring_cap], sizeof(xrec_t));
        self->ring_head = (self->ring_head + n) % self->ring_cap;
        self->ring_len = 0;
    }
    pthread_mutex_unlock(&self->mu);
    if (n && !tmp) return PyErr_NoMemory();
    PyObject *out = PyBytes_FromStringAndSize(tmp ? tmp : "", (Py_ssize_t)n * sizeof(xrec_t));
    free(tmp);
    return out;
}

static PyObject *Core_take_events(Core *self, PyObject *args) {
    NEED_READY(self);
    /* (events as packed ev_t records, evidence time). all=True first flushes every path's pending
     * ANSWERED, so the caller sees every reply; all=False leaves them accumulating (cheap polls
     * that still see every MISS and LATE at once) */
    int all = 1;
    if (!PyArg_ParseTuple(args, "|p", &all)) return NULL;
    pthread_mutex_lock(&self->mu);
    if (all)
        for (int i = 0; i < self->npaths; i++) flush_answered(self, &self->paths[i]);
    uint32_t n = self->ev_len;
    self->notify = 0; /* whatever was pushed is being taken now */
    char *buf = malloc((size_t)n * sizeof(ev_t) + 1);
    int64_t evidence = self->evidence_local;
    if (buf) {
        for (uint32_t i = 0; i < n; i++)
            memcpy(buf + (size_t)i * sizeof(ev_t), &self->evring[(self->ev_head + i) % self->ring_cap], sizeof(ev_t));
        self->ev_head = (self->ev_head + n) % self->ring_cap;
        self->ev_len = 0;
    }
    pthread_mutex_unlock(&self->mu);
    if (!buf) return PyErr_NoMemory();
    PyObject *out = Py_BuildValue("(y#L)", buf, (Py_ssize_t)n * sizeof(ev_t), (long long)evidence);
    free(buf);
    return out;
}

static PyObject *Core_fileno(Core *self, PyObject *Py_UNUSED(ignored)) {
    NEED_READY(self);
    /* the eventfd: wait for it to be readable, then read 8 bytes and take_events() */
    return PyLong_FromLong(self->efd);
}

static PyObject *Core_track(Core *self, PyObject *args) {
    NEED_READY(self);
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    pthread_mutex_lock(&self->mu);
    self->tracking = (uint32_t)on;
    self->ev_len = 0;
    for (int i = 0; i < self->npaths; i++) {
        path_t *pt = &self->paths[i];
        memset(pt->out, 0, OUT_SLOTS * sizeof(out_t));
        pt->exp_seq = pt->next_seq;
        pt->agg.count = 0;
    }
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Core_set_rto(Core *self, PyObject *args) {
    NEED_READY(self);
    unsigned int path_id;
    long long rto;
    if (!PyArg_ParseTuple(args, "IL", &path_id, &rto)) return NULL;
    if (rto < 1000 || rto > 60000000000LL) return PyErr_Format(PyExc_ValueError, "rto must be 1 us .. 60 s");
    pthread_mutex_lock(&self->mu);
    int i = path_index(self, path_id);
    if (i >= 0) self->paths[i].rto_ns = rto; /* for requests sent from now: a deadline is fixed when sent */
    pthread_mutex_unlock(&self->mu);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    Py_RETURN_NONE;
}

/* set_confirm(threshold, per_s, burst[, spread_ns]): confirmation rounds on each miss of a streak
 * up to the one that completes `threshold` misses in a row (0: none), at most `burst` rounds per
 * peer, refilled at `per_s` a second; the DOWN-making miss's round no sooner than `spread_ns`
 * after the streak's first miss was sent */
static PyObject *Core_set_confirm(Core *self, PyObject *args) {
    NEED_READY(self);
    unsigned int threshold, burst;
    double per_s;
    long long spread_ns = 0;
    if (!PyArg_ParseTuple(args, "IdI|L", &threshold, &per_s, &burst, &spread_ns)) return NULL;
    if (threshold > 1000 || !(per_s >= 0.01 && per_s <= 10000.0) || burst < 1 || burst > 1000
        || spread_ns < 0 || spread_ns > 1000000000LL)
        return PyErr_Format(PyExc_ValueError, "threshold 0..1000, per_s 0.01..10000, burst 1..1000, spread_ns 0..1e9");
    pthread_mutex_lock(&self->mu);
    self->confirm_threshold = threshold;
    self->confirm_period_ns = (int64_t)(1e9 / per_s);
    self->confirm_burst = burst;
    self->confirm_spread_ns = spread_ns;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Core_set_size_probe(Core *self, PyObject *args) {
    NEED_READY(self);
    unsigned int path_id, every;
    int pad;
    if (!PyArg_ParseTuple(args, "IIi", &path_id, &every, &pad)) return NULL;
    if (pad < 0 || pad > MAX_PAD) return PyErr_Format(PyExc_ValueError, "pad must be 0..%d", MAX_PAD);
    pthread_mutex_lock(&self->mu);
    int i = path_index(self, path_id);
    if (i >= 0) {
        self->paths[i].size_every = every;
        self->paths[i].size_pad = (uint16_t)pad;
        update_pads(self);
    }
    pthread_mutex_unlock(&self->mu);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    Py_RETURN_NONE;
}

/* set_keys(key, accept_key=b""): sign with `key` from now on, accept `accept_key` too (empty:
 * no other key). Taken under the loop's lock, so a packet is checked against one pair or the other. */
static PyObject *Core_set_keys(Core *self, PyObject *args) {
    NEED_READY(self);
    Py_buffer key, other = {0};
    if (!PyArg_ParseTuple(args, "y*|y*", &key, &other)) return NULL;
    int bad = key.len < FLEET_KEY_MIN || key.len > FLEET_KEY_MAX ||
              (other.buf && other.len && (other.len < FLEET_KEY_MIN || other.len > FLEET_KEY_MAX));
    if (!bad) {
        pthread_mutex_lock(&self->mu);
        rx_set_keys(&self->rx, key.buf, (size_t)key.len, other.buf && other.len ? other.buf : NULL,
                    other.buf ? (size_t)other.len : 0);
        pthread_mutex_unlock(&self->mu);
    }
    PyBuffer_Release(&key);
    if (other.buf) PyBuffer_Release(&other);
    if (bad) return PyErr_Format(PyExc_ValueError, "fleet key must be %d..%d bytes", FLEET_KEY_MIN, FLEET_KEY_MAX);
    Py_RETURN_NONE;
}

static PyObject *Core_counters(Core *self, PyObject *Py_UNUSED(ignored)) {
    NEED_READY(self);
    uint64_t drops_now[D_COUNT];
    pthread_mutex_lock(&self->mu);
    memcpy(drops_now, self->rx.drops, sizeof drops_now);
    uint64_t v[15] = {self->sent, self->reflected, self->replies, self->received, self->wakeups, self->evidence_updates,
                      self->rx.reflect_used, self->rx.expired, self->rx.other_key_ok, 0, 0,
                      self->confirm_rounds, self->confirm_probes, self->confirm_refused, 0};
    pthread_mutex_unlock(&self->mu);
    pthread_mutex_lock(&self->lane_mu);
    v[9] = self->lane_looks;
    v[10] = self->lane_changes;
    v[14] = self->lane_deferred;
    pthread_mutex_unlock(&self->lane_mu);
    PyObject *drops = PyDict_New();
    if (!drops) return NULL;
    for (int i = 0; i < D_COUNT; i++) {
        if (!drops_now[i]) continue;
        PyObject *n = PyLong_FromUnsignedLongLong(drops_now[i]);
        if (!n || PyDict_SetItemString(drops, DROP_NAMES[i], n) < 0) { Py_XDECREF(n); Py_DECREF(drops); return NULL; }
        Py_DECREF(n);
    }
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:N}", "sent", v[0],
                         "reflected", v[1], "replies", v[2], "received", v[3], "wakeups", v[4], "evidence_updates", v[5],
                         "reflector_entries", v[6], "reflector_expired", v[7], "other_key", v[8], "lane_looks", v[9],
                         "lane_changes", v[10], "confirm_rounds", v[11], "confirm_probes", v[12],
                         "confirm_refused", v[13], "lane_deferred", v[14], "drops", drops);
}

static PyObject *Core_declare_pads(Core *self, PyObject *args) {
    NEED_READY(self);
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "O", &seq)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "declare_pads takes a sequence of paddings");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint16_t pads[MAX_DECLARED];
    if (n > MAX_DECLARED) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "at most %d declared probe sizes, got %zd", MAX_DECLARED, n);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) { Py_DECREF(fast); return NULL; }
        if (v < 0 || v > MAX_PAD) {
            Py_DECREF(fast);
            return PyErr_Format(PyExc_ValueError, "padding %ld: must be 0..%d", v, MAX_PAD);
        }
        pads[i] = (uint16_t)v;
    }
    Py_DECREF(fast);
    pthread_mutex_lock(&self->mu);
    memcpy(self->declared, pads, (size_t)n * sizeof pads[0]);
    self->ndeclared = (int)n;
    update_pads(self);
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Core_set_budget(Core *self, PyObject *args) {
    NEED_READY(self);
    long long src_rate, src_burst, shared_rate, shared_burst;
    if (!PyArg_ParseTuple(args, "LLLL", &src_rate, &src_burst, &shared_rate, &shared_burst)) return NULL;
    const long long max_rate = 1000000000LL, max_burst = 1LL << 40;
    if (src_rate < 1 || src_rate > max_rate || shared_rate < 1 || shared_rate > max_rate || src_burst < 1 ||
        src_burst > max_burst || shared_burst < 1 || shared_burst > max_burst)
        return PyErr_Format(PyExc_ValueError, "rates must be 1..%lld bytes/s and bursts 1..%lld bytes", max_rate, max_burst);
    pthread_mutex_lock(&self->mu);
    self->rx.src_rate = src_rate; self->rx.src_burst = src_burst;
    self->rx.shared_rate = shared_rate; self->rx.shared_burst = shared_burst;
    if (self->rx.shared.tokens > shared_burst) self->rx.shared.tokens = shared_burst;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Core_set_reflector_idle(Core *self, PyObject *args) {
    NEED_READY(self);
    long long idle;
    if (!PyArg_ParseTuple(args, "L", &idle)) return NULL;
    if (idle < 1000000LL || idle > 3600000000000LL) return PyErr_Format(PyExc_ValueError, "idle timeout must be 1 ms .. 1 h");
    pthread_mutex_lock(&self->mu);
    self->rx.idle_ns = idle;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Core_path_sent(Core *self, PyObject *args) {
    NEED_READY(self);
    unsigned int path_id;
    if (!PyArg_ParseTuple(args, "I", &path_id)) return NULL;
    int i = path_index(self, path_id);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    return PyLong_FromUnsignedLongLong(self->paths[i].sent);
}

/* test entry points: the same encoder/decoder the loop uses */
static PyObject *Core_encode(Core *self, PyObject *args) {
    NEED_READY(self);
    probe_t p = {0};
    unsigned int kind, flags, pad, sport, dport;
    PyObject *src, *dst;
    if (!PyArg_ParseTuple(args, "IIIIIIKLLLLIOOII", &kind, &flags, &pad, &p.sender, &p.reflector, &p.path, &p.seq,
                          &p.t1, &p.t2, &p.t3, &p.t4, &p.rx_count, &src, &dst, &sport, &dport))
        return NULL;
    if (pad > MAX_PAD) return PyErr_Format(PyExc_ValueError, "pad > %d", MAX_PAD);
    p.kind = (uint8_t)kind; p.flags = (uint8_t)flags; p.pad = (uint16_t)pad;
    uint8_t s[4], d[4];
    if (get_addr(src, s) < 0 || get_addr(dst, d) < 0) return NULL;
    uint8_t *buf = PyMem_Malloc(MIN_PAYLOAD + MAX_PAD);
    if (!buf) return PyErr_NoMemory();
    size_t n = encode(&self->rx.keyed, &p, s, d, (uint16_t)sport, (uint16_t)dport, buf);
    PyObject *out = PyBytes_FromStringAndSize((char *)buf, (Py_ssize_t)n);
    PyMem_Free(buf);
    return out;
}

static PyObject *Core_decode(Core *self, PyObject *args) {
    NEED_READY(self);
    Py_buffer data;
    PyObject *src, *dst;
    unsigned int sport, dport;
    if (!PyArg_ParseTuple(args, "y*OOII", &data, &src, &dst, &sport, &dport)) return NULL;
    uint8_t s[4], d[4];
    if (get_addr(src, s) < 0 || get_addr(dst, d) < 0) { PyBuffer_Release(&data); return NULL; }
    probe_t p;
    int why = decode(&self->rx.keyed, data.buf, (size_t)data.len, s, d, (uint16_t)sport, (uint16_t)dport, &p);
    PyBuffer_Release(&data);
    if (why >= 0) return PyUnicode_FromString(DROP_NAMES[why]);
    /* same field order as wire.Probe */
    return Py_BuildValue("(IIIIKLLLLIII)", p.kind, p.sender, p.reflector, p.path, p.seq, p.t1, p.t2, p.t3, p.t4,
                         p.rx_count, p.flags, p.pad);
}

static PyObject *Core_replay_test(Core *self, PyObject *args) {
    NEED_READY(self);
    /* feed a list of sequence numbers to a fresh replay window; returns the accept decisions */
    PyObject *seqs;
    if (!PyArg_ParseTuple(args, "O", &seqs)) return NULL;
    PyObject *it = PyObject_GetIter(seqs);
    if (!it) return NULL;
    replay_t w;
    memset(&w, 0, sizeof w);
    PyObject *out = PyList_New(0), *item;
    while (out && (item = PyIter_Next(it))) {
        unsigned long long s = PyLong_AsUnsignedLongLong(item);
        Py_DECREF(item);
        if (PyErr_Occurred()) { Py_CLEAR(out); break; }
        PyObject *b = PyBool_FromLong(replay_accept(&w, s));
        PyList_Append(out, b);
        Py_DECREF(b);
    }
    Py_DECREF(it);
    return out;
}

static int64_t stamp_given(void *ctx) { return *(const int64_t *)ctx; }

static PyObject *Core_receive_test(Core *self, PyObject *args) {
    /* one packet through the loop's receive path at monotonic time now_ns (t2 = t3 = now_ns),
     * after the reflector sweep the loop runs at each wake-up */
    NEED_READY(self);
    Py_buffer data;
    PyObject *src, *dst;
    unsigned int sport;
    long long now;
    if (!PyArg_ParseTuple(args, "y*OOIL", &data, &src, &dst, &sport, &now)) return NULL;
    uint8_t s[4], d[4];
    if (get_addr(src, s) < 0 || get_addr(dst, d) < 0) { PyBuffer_Release(&data); return NULL; }
    uint8_t *out = PyMem_Malloc(MAX_PKT);
    if (!out) { PyBuffer_Release(&data); return PyErr_NoMemory(); }
    probe_t p;
    size_t len = 0;
    int64_t t = now;
    pthread_mutex_lock(&self->mu);
    rx_sweep(&self->rx, t, SWEEP_SLOTS);
    int what = rx_handle(&self->rx, data.buf, (size_t)data.len, s, d, (uint16_t)sport, t, t, stamp_given, &t, &p, out,
                         &len);
    pthread_mutex_unlock(&self->mu);
    PyBuffer_Release(&data);
    PyObject *res;
    if (what == RX_REFLECTED) res = PyBytes_FromStringAndSize((char *)out, (Py_ssize_t)len);
    else if (what == RX_REPLY)
        res = Py_BuildValue("(IIIIKLLLLIII)", p.kind, p.sender, p.reflector, p.path, p.seq, p.t1, p.t2, p.t3, p.t4,
                            p.rx_count, p.flags, p.pad);
    else res = PyUnicode_FromString(DROP_NAMES[what]);
    PyMem_Free(out);
    return res;
}

/* Test hooks for judging mode: the loop's own bookkeeping, with times given instead of read from
 * the clocks, so a test can lay out a timeline (tests/unit/test_probe_judging.py). judge_send is what
 * queue_probe and tx_flush record for a request sendmmsg took; judge_receive hands a UDP payload
 * to the receive path as the loop does for a packet read on NIC 0 (a request is reflected into a
 * batch that is never sent); judge_evidence moves the evidence time as an emptied wake-up does. */
static PyObject *Core_judge_send(Core *self, PyObject *args) {
    NEED_READY(self);
    unsigned int path_id, size;
    long long t1;
    if (!PyArg_ParseTuple(args, "ILI", &path_id, &t1, &size)) return NULL;
    pthread_mutex_lock(&self->mu);
    int i = path_index(self, path_id);
    uint64_t seq = 0;
    if (i >= 0) {
        seq = self->paths[i].next_seq++;
        request_sent(self, &self->paths[i], seq, t1, size ? 1 : 0, 0);
    }
    pthread_mutex_unlock(&self->mu);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    return PyLong_FromUnsignedLongLong(seq);
}

static PyObject *Core_judge_receive(Core *self, PyObject *args) {
    NEED_READY(self);
    Py_buffer data;
    PyObject *src;
    unsigned int sport;
    long long t_rx;
    if (!PyArg_ParseTuple(args, "y*OIL", &data, &src, &sport, &t_rx)) return NULL;
    struct sockaddr_in from;
    memset(&from, 0, sizeof from);
    from.sin_family = AF_INET;
    from.sin_port = htons((uint16_t)sport);
    txbatch_t *tx = PyMem_Calloc(1, sizeof(txbatch_t));
    uint8_t *buf = PyMem_Malloc((size_t)BATCH * MAX_PKT);
    int bad = get_addr(src, (uint8_t *)&from.sin_addr) < 0;
    if (!bad && (!tx || !buf)) { PyErr_NoMemory(); bad = 1; }
    if (!bad && !self->nnics) { PyErr_SetString(PyExc_ValueError, "add a NIC first"); bad = 1; }
    if (!bad) {
        tx->buf = buf;
        pthread_mutex_lock(&self->mu);
        handle_packet(self, 0, data.buf, (size_t)data.len, &from, t_rx, now_ns(CLOCK_MONOTONIC), tx);
        pthread_mutex_unlock(&self->mu);
    }
    PyMem_Free(buf);
    PyMem_Free(tx);
    PyBuffer_Release(&data);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_judge_evidence(Core *self, PyObject *args) {
    NEED_READY(self);
    long long t;
    if (!PyArg_ParseTuple(args, "L", &t)) return NULL;
    pthread_mutex_lock(&self->mu);
    set_evidence(self, t);
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyMethodDef Core_methods[] = {
    {"add_nic", (PyCFunction)Core_add_nic, METH_VARARGS, "add_nic(rx_fd, tx_fd, addr4) -> index"},
    {"add_path", (PyCFunction)Core_add_path, METH_VARARGS,
     "add_path(path_id, nic, peer_id, peer_addr4, sport, interval_ns, pad, first_due_monotonic_ns[, pair_gap_ns])"},
    {"remove_path", (PyCFunction)Core_remove_path, METH_VARARGS, "remove_path(path_id)"},
    {"set_confirm", (PyCFunction)Core_set_confirm, METH_VARARGS,
     "set_confirm(threshold, per_s, burst[, spread_ns]): confirmation rounds on each miss of a streak, up to the one that completes threshold misses in a row"},
    {"set_interval", (PyCFunction)Core_set_interval, METH_VARARGS, "set_interval(path_id, interval_ns)"},
    {"set_clock", (PyCFunction)Core_set_clock, METH_VARARGS, "set_clock(base_true_ns, base_local_ns, rate_ppb)"},
    {"watch_lanes", (PyCFunction)Core_watch_lanes, METH_VARARGS,
     "watch_lanes(fds, window_ns, silent_ns): look at these lane reports every half window (the core keeps its own "
     "duplicates; an empty sequence stops); a look that finds what the rate rule reads changed sets lanes_changed() "
     "and wakes fileno()"},
    {"lanes_changed", (PyCFunction)Core_lanes_changed, METH_NOARGS,
     "whether a lane look found a change since the last call (and clears it)"},
    {"lane_digest", (PyCFunction)Core_lane_digest, METH_VARARGS,
     "test hook: lane_digest(report_bytes, now_ns, window_ns, silent_ns): the look's digest of one report"},
    {"run", (PyCFunction)Core_run, METH_VARARGS, "run(duration_ns): probe, reflect, receive; GIL released"},
    {"start", (PyCFunction)Core_start, METH_VARARGS,
     "start([rt_priority]): run the loop in a native background thread (GIL-free), SCHED_FIFO if > 0"},
    {"rt_status", (PyCFunction)Core_rt_status, METH_NOARGS, "0, or the errno the thread got asking for SCHED_FIFO"},
    {"stop", (PyCFunction)Core_stop, METH_NOARGS, "stop the background thread and wait for it"},
    {"take", (PyCFunction)Core_take, METH_NOARGS, "completed exchanges as packed '<IIQqqqq' records"},
    {"take_events", (PyCFunction)Core_take_events, METH_VARARGS,
     "take_events(all=True) -> (events '<IIQIIIIqqqq' (kind, path, seq, count, rx_count, size, worst_rtt, t1..t4), evidence_ns)"},
    {"track", (PyCFunction)Core_track, METH_VARARGS, "track(on): judging mode (see the ev_t comment)"},
    {"fileno", (PyCFunction)Core_fileno, METH_NOARGS, "eventfd, readable when a MISS or LATE waits"},
    {"set_rto", (PyCFunction)Core_set_rto, METH_VARARGS, "set_rto(path_id, rto_ns): deadline of the next requests"},
    {"set_size_probe", (PyCFunction)Core_set_size_probe, METH_VARARGS,
     "set_size_probe(path_id, every, pad): every Nth probe carries `pad` bytes (0: off)"},
    {"set_keys", (PyCFunction)Core_set_keys, METH_VARARGS,
     "set_keys(key[, accept_key]): sign with key, accept accept_key too (a fleet key rotation; b'' = none)"},
    {"counters", (PyCFunction)Core_counters, METH_NOARGS,
     "sent/reflected/replies/received, reflector entries (now) and expired, and drops by reason"},
    {"declare_pads", (PyCFunction)Core_declare_pads, METH_VARARGS,
     "declare_pads(paddings): probe sizes peers send besides the small one and this core's own (replaces the last)"},
    {"set_budget", (PyCFunction)Core_set_budget, METH_VARARGS,
     "set_budget(src_rate, src_burst, shared_rate, shared_burst): bytes of forged packets checked per source / "
     "for all untrusted sources, per second and at once"},
    {"set_reflector_idle", (PyCFunction)Core_set_reflector_idle, METH_VARARGS,
     "set_reflector_idle(ns): a reflector entry unheard for this long is freed"},
    {"path_sent", (PyCFunction)Core_path_sent, METH_VARARGS, "requests sent on a path"},
    {"encode", (PyCFunction)Core_encode, METH_VARARGS, "test hook: the loop's encoder"},
    {"decode", (PyCFunction)Core_decode, METH_VARARGS, "test hook: the loop's decoder; a str is a drop reason"},
    {"replay_test", (PyCFunction)Core_replay_test, METH_VARARGS, "test hook: replay window decisions"},
    {"judge_send", (PyCFunction)Core_judge_send, METH_VARARGS,
     "test hook: judge_send(path_id, t1, size_probe) -> seq, a request sent at t1 (local clock)"},
    {"judge_receive", (PyCFunction)Core_judge_receive, METH_VARARGS,
     "test hook: judge_receive(udp_payload, src_addr4, sport, t_rx): a packet read on NIC 0 at t_rx"},
    {"judge_evidence", (PyCFunction)Core_judge_evidence, METH_VARARGS,
     "test hook: judge_evidence(t): every packet before t (local clock) has been read"},
    {"receive_test", (PyCFunction)Core_receive_test, METH_VARARGS,
     "test hook: receive_test(payload, src4, dst4, sport, now_ns) through the loop's receive path -> the reply "
     "it reflects (an IP packet, bytes), an authenticated reply (a wire.Probe tuple), or a drop reason (str)"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "linkpass.probe._probecore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Core_new,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_doc = "The probe engine's data path for one agent (see module docstring).",
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "linkpass.probe._probecore",
                                    "Compiled per-packet data path of the LinkPass probe engine.", -1, NULL};

PyMODINIT_FUNC PyInit__probecore(void) {
    crc_init();
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    PyModule_AddObject(m, "Core", (PyObject *)&CoreType);
    PyModule_AddIntConstant(m, "RECORD_SIZE", sizeof(xrec_t));
    PyModule_AddIntConstant(m, "EVENT_SIZE", sizeof(ev_t));
    PyModule_AddIntConstant(m, "MAX_PAD", MAX_PAD);
    PyModule_AddIntConstant(m, "MAX_PATHS", MAX_PATHS);
    PyModule_AddIntConstant(m, "REFLECT_MAX", REFLECT_MAX);
    return m;
}
