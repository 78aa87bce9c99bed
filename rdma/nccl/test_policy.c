/* test_policy: every decision of lp_policy.c, without a network (tests/unit/test_nccl_plugin.py builds
 * and runs it). Prints "ok N" and exits 0, or names the failed check and exits 1. */
#include <stdio.h>
#include <stdlib.h>

#include "lp_policy.h"

static int checks;
#define CHECK(cond) do { checks++; if (!(cond)) { printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); exit(1); } } while (0)
#define MS 1000000ull

int main(void) {
    /* the state machine: every (state, event) pair */
    static const int want[LP_NSTATES][LP_NEVENTS] = {
        {LP_CONNECTING, -1, -1, LP_DOWN}, {-1, LP_HELLO, -1, LP_DOWN}, {-1, -1, LP_LIVE, LP_DOWN}, {-1, -1, -1, LP_DOWN}};
    for (int s = 0; s < LP_NSTATES; s++)
        for (int e = 0; e < LP_NEVENTS; e++) CHECK(lp_lane_next(s, e) == want[s][e]);
    CHECK(lp_lane_next(-1, 0) == -1 && lp_lane_next(0, LP_NEVENTS) == -1);

    /* flap damping: 0, 100, 200, 400 ... ms, at most 10 s */
    CHECK(lp_hold_ns(0) == 0 && lp_hold_ns(1) == 0 && lp_hold_ns(2) == 100 * MS && lp_hold_ns(3) == 200 * MS);
    CHECK(lp_hold_ns(8) == 6400 * MS && lp_hold_ns(9) == 10000 * MS && lp_hold_ns(50) == 10000 * MS);
    struct lp_health h = {0};
    uint64_t t = 1000 * MS;
    CHECK(lp_health_down(&h, t) == t);               /* first failure: retry at once */
    lp_health_up(&h, t + 1 * MS);
    CHECK(lp_health_down(&h, t + 2 * MS) == t + 102 * MS); /* flapping: held out */
    lp_health_up(&h, t + 200 * MS);
    CHECK(lp_health_down(&h, t + 201 * MS) == t + 401 * MS);
    CHECK(h.penalty == 3);
    lp_health_up(&h, t + 500 * MS);
    lp_health_tick(&h, t + 500 * MS + LP_DECAY_NS - 1);
    CHECK(h.penalty == 3);                            /* not forgiven before 10 s up */
    lp_health_tick(&h, t + 500 * MS + LP_DECAY_NS);
    CHECK(h.penalty == 2);
    lp_health_tick(&h, t + 500 * MS + LP_DECAY_NS + 1);
    CHECK(h.penalty == 2);                            /* one per 10 s */
    lp_health_tick(&h, t + 500 * MS + 2 * LP_DECAY_NS);
    lp_health_tick(&h, t + 500 * MS + 3 * LP_DECAY_NS);
    lp_health_tick(&h, t + 500 * MS + 4 * LP_DECAY_NS);
    CHECK(h.penalty == 0);                            /* and never below zero */

    /* the stuck bound */
    struct lp_health r = {0};
    CHECK(lp_stuck_bound(&r, 50 * MS, 1) == 50 * MS);
    CHECK(lp_stuck_bound(&r, 50 * MS, 0) == LP_IDLE_BOUND_NS);
    lp_health_rtt(&r, 10 * MS);
    CHECK(r.srtt_ns == 10 * MS && lp_stuck_bound(&r, 50 * MS, 1) == 80 * MS);
    lp_health_rtt(&r, 2 * MS);
    CHECK(r.srtt_ns == (70 * MS + 2 * MS) / 8);
    struct lp_health slow = {.srtt_ns = 100 * MS};
    CHECK(lp_stuck_bound(&slow, 50 * MS, 0) == 800 * MS);

    /* the plane */
    int none[4] = {0}, all[4] = {1, 1, 1, 1}, u[4] = {2, 1, 1, 0}, l[4] = {2, 1, 1, 1};
    CHECK(lp_pick_plane(0, 4, none, u, l) == 0);      /* rail locality */
    CHECK(lp_pick_plane(2, 4, none, u, l) == 2);
    int av0[4] = {1, 0, 0, 0};
    CHECK(lp_pick_plane(0, 4, av0, u, l) == 1);       /* the table moves it off plane 0 */
    int u0[4] = {0, 0, 1, 0};
    CHECK(lp_pick_plane(0, 4, none, u0, l) == 2);     /* no usable lane on 0 or 1 */
    CHECK(lp_pick_plane(3, 4, none, u, l) == 0);      /* own plane 3 has only a slow lane: others first */
    CHECK(lp_pick_plane(1, 4, all, u, l) == 1);       /* every plane marked: still the own plane */
    int z[4] = {0};
    CHECK(lp_pick_plane(3, 4, none, z, l) == 3);      /* nothing usable: a live (slow) lane still carries */
    CHECK(lp_pick_plane(0, 4, none, z, z) == -1);

    /* RoCEv2 source ports: every port of the range has a flow label that yields it, and the
     * mapping is the kernel's (values captured from rxe: 0x12345 -> 58177, 0xABCDE -> 64756) */
    CHECK(lp_sport_of_flow_label(0x12345) == 58177 && lp_sport_of_flow_label(0xABCDE) == 64756);
    CHECK(lp_sport_of_flow_label(0x00001) == 49153);
    for (unsigned p = LP_SPORT_MIN; p <= 0xFFFF; p++) {
        uint32_t fl = lp_flow_label_for_sport((uint16_t)p);
        CHECK(fl != 0 && fl <= 0xFFFFF && lp_sport_of_flow_label(fl) == p);
    }
    CHECK(lp_flow_label_for_sport(4791) == 0 && lp_flow_label_for_sport(0xBFFF) == 0);

    /* the table's verdict on a lane's port */
    uint16_t hp[3] = {50000, 50001, 50002};
    CHECK(lp_port_verdict(hp, 3, 1, 0, 50001) == LP_PORT_KEEP);
    CHECK(lp_port_verdict(hp, 3, 1, 0, 50009) == LP_PORT_LEFT);
    CHECK(lp_port_verdict(hp, 3, 0, 0, 50009) == LP_PORT_KEEP);   /* no entry: nothing known */
    CHECK(lp_port_verdict(hp, 3, 1, 1, 50009) == LP_PORT_KEEP);   /* fail-static: keep what works */
    CHECK(lp_port_verdict(hp, 0, 1, 0, 50009) == LP_PORT_KEEP);   /* no healthy port: the plane mark decides */

    /* a (re)connecting lane's port */
    uint16_t used1[1] = {50000}, used2[2] = {50000, 50001}, used3[3] = {50000, 50001, 50002};
    CHECK(lp_pick_port(hp, 3, NULL, 0, 0, 0, 60000) == 50000);         /* the table's order from key */
    CHECK(lp_pick_port(hp, 3, NULL, 0, 0, 4, 60000) == 50001);
    CHECK(lp_pick_port(hp, 3, used1, 1, 0, 0, 60000) == 50001);        /* an unused healthy port first */
    CHECK(lp_pick_port(hp, 3, used2, 2, 50002, 0, 60000) == 50000);    /* not the port it failed on... */
    CHECK(lp_pick_port(hp, 1, used1, 1, 50000, 0, 60000) == 50000);    /* ...unless it is the only one */
    CHECK(lp_pick_port(hp, 3, used3, 3, 0, 1, 60000) == 50001);        /* all in use: the least used */
    CHECK(lp_pick_port(hp, 0, used3, 3, 0, 1, 60000) == 60000);        /* no table: a fresh random port */

    /* spreading lanes again once a path is back */
    uint16_t two[2] = {50000, 50001}, lanes4[4] = {50000, 50000, 50000, 50000}, lanes4b[4] = {50000, 50001, 50000, 50001};
    CHECK(lp_pick_rebalance(lanes4, 4, two, 2) >= 0);                  /* 4 on one path, 0 on the other */
    CHECK(lp_pick_rebalance(lanes4b, 4, two, 2) == -1);                /* 2 and 2 */
    uint16_t lanes2[2] = {50000, 50000}, lanes3[3] = {50000, 50000, 50001};
    CHECK(lp_pick_rebalance(lanes2, 2, two, 2) >= 0);                  /* 2 and 0 */
    CHECK(lp_pick_rebalance(lanes3, 3, two, 2) == -1);                 /* 2 and 1: within one */
    CHECK(lp_pick_rebalance(lanes2, 2, two, 1) == -1);                 /* one healthy path: nowhere to go */
    uint16_t gone[2] = {50007, 50007};
    CHECK(lp_pick_rebalance(gone, 2, two, 2) == -1);                   /* ports that left: not this rule's */
    printf("ok %d\n", checks);
    return 0;
}
