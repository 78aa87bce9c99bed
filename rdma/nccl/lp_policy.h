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

#endif
