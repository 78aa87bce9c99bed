/*
 * lp_policy.h: the NCCL plugin's decisions as pure functions: no sockets, no clock reads (time
 * comes in as an argument), no global state. lp_plugin.c calls them; test_policy.c drives them
 * through every case without a network.
 *
 * - The send lane's state machine, as a table: DOWN -(hold-out over)-> CONNECTING -(TCP up)->
 *   HELLO -(handshake answered)-> LIVE; a failure (socket error, timeout, stuck) from any state
 *   -> DOWN. Receive lanes are simpler (live until their socket fails) and are not in the table.
 * - Flap damping: every failure doubles the hold-out before the next attempt (0, 100 ms, 200 ms,
 *   ... at most 10 s); every 10 s up forgives one failure.
 * - The stuck bound: max(LINKPASS_STUCK_MS, 8 x smoothed RTT) while the lane carries data;
 *   an idle lane's ping is judged after at least 250 ms.
 * - The plane chunks go to: the own plane first, then the others in order; a plane marked
 *   unusable by the entropy table is skipped while another has a usable lane; with no usable
 *   lane anywhere, any live (slow) lane still carries the data.
 * - Verbs lanes' paths: the RoCEv2 source port a lane's queue pairs carry (and the flow label that
 *   yields it), the port a lane takes when it (re)connects, whether the entropy table says its port
 *   left the healthy set, and which lane moves when a healthy port carries too few lanes.
 */
#ifndef LINKPASS_LP_POLICY_H
#define LINKPASS_LP_POLICY_H

#include <stdint.h>

enum lp_lane_state { LP_DOWN, LP_CONNECTING, LP_HELLO, LP_LIVE, LP_NSTATES };
enum lp_lane_event { LP_EV_HOLD_OVER, LP_EV_CONNECTED, LP_EV_HELLO_OK, LP_EV_FAIL, LP_NEVENTS };

/* The next state, or -1 if the event cannot happen in that state. */
int lp_lane_next(int state, int event);
extern const char *const lp_lane_state_name[LP_NSTATES];

#define LP_HOLD_STEP_NS 100000000ull    /* the second failure's hold-out */
#define LP_HOLD_MAX_NS 10000000000ull   /* longest hold-out */
#define LP_DECAY_NS 10000000000ull      /* up this long forgives one failure */
#define LP_IDLE_BOUND_NS 250000000ull   /* an unanswered ping alone: stuck after this */

struct lp_health {
    int penalty;            /* failures not yet forgiven */
    uint64_t last_decay_ns; /* when the penalty last decayed (or the lane came up) */
    uint64_t srtt_ns;       /* smoothed RTT, 0 = no sample yet */
};

uint64_t lp_hold_ns(int penalty);
/* The lane failed at now: returns when it may try again. */
uint64_t lp_health_down(struct lp_health *h, uint64_t now);
/* The lane came up at now. */
void lp_health_up(struct lp_health *h, uint64_t now);
/* The lane is still up at now: forgive a failure per LP_DECAY_NS. */
void lp_health_tick(struct lp_health *h, uint64_t now);
void lp_health_rtt(struct lp_health *h, uint64_t rtt_ns);
/* How long a lane may go without an answer before it is stuck. */
uint64_t lp_stuck_bound(const struct lp_health *h, uint64_t stuck_min_ns, int carrying_data);

/* The plane for the next chunk: own first, then 0..nplanes-1 skipping own. usable[q] / live[q]
 * count plane q's usable and live lanes; avoid[q] is the entropy table's mark. -1: no live lane. */
int lp_pick_plane(int own, int nplanes, const int *avoid, const int *usable, const int *live);

/* ---- verbs lanes: RoCEv2 source ports ---- */

#define LP_SPORT_MIN 0xC000u /* the range a GRH flow label reaches: 0xC000..0xFFFF */

/* The kernel's mapping (rdma_flow_label_to_udp_sport): port = 0xC000 | (fl[13:0] ^ fl[19:14]). */
uint16_t lp_sport_of_flow_label(uint32_t flow_label);
/* A non-zero flow label that yields sport (0 would let the kernel pick one from the QP numbers);
 * 0 for a port below 0xC000, which no flow label reaches. */
uint32_t lp_flow_label_for_sport(uint16_t sport);

enum { LP_PORT_KEEP, LP_PORT_LEFT };
/* What the entropy table says of a lane's port: LEFT when the peer's entry lists healthy ports and
 * this is not one of them; KEEP when it is one, or when there is no entry, the entry is
 * fail-static (every path bad: the last usable ports, keep what works) or lists no port. */
int lp_port_verdict(const uint16_t *healthy, int nhealthy, int have_entry, int fail_static, uint16_t port);

/* The port a lane takes when it (re)connects: a healthy port no other lane of its plane uses,
 * trying them in the table's order from index key % nhealthy, not prev if another will do; else
 * the healthy port the fewest other lanes use (not prev if possible); with no healthy port,
 * fallback (a fresh random port of the range: a fresh path). used[] are the other lanes' ports. */
uint16_t lp_pick_port(const uint16_t *healthy, int nhealthy, const uint16_t *used, int nused, uint16_t prev,
                      unsigned key, uint16_t fallback);

/* Spreading lanes over healthy paths again (after one came back): the index into ports[] (one
 * per lane of a plane) of a lane to re-make, when some healthy port carries at least two lanes
 * fewer than another healthy port; -1 when the lanes are spread within one. */
int lp_pick_rebalance(const uint16_t *ports, int nlanes, const uint16_t *healthy, int nhealthy);

#endif
