/*
 * lp_steer_policy.h: the steering shim's decisions as pure functions (no verbs calls, no files,
 * no global state). lp_steer.c gathers the facts about one ibv_modify_qp call and the entropy
 * table; these functions say whether to steer it and to which port; test_steer_policy.c drives
 * every case.
 *
 * A call is steered only when every guard passes, cheapest first; each refusal has a name (the
 * shim counts and logs them by name):
 *
 *   guard                                   refusal            what the shim does
 *   attr_mask has STATE, qp_state is RTR    not_rtr            untouched (the common case: other transitions)
 *   QP type is RC                           not_rc             untouched (UD/UC/XRC keep the hash's port)
 *   attr_mask has AV, ah_attr.is_global     no_grh             untouched (no GRH: not RoCE v2)
 *   flow label 0, or override asked         app_label          untouched (the application chose its path)
 *   the source GID is RoCE v2               not_roce_v2        untouched (IB, RoCE v1: no UDP port)
 *   a trusted, consistent table             no_table           untouched (no agent, or a table not to trust)
 *   an entry for the destination address    not_linkpass       untouched (a peer LinkPass does not probe)
 *   that entry has a port                   no_port            untouched (nothing healthy known)
 *   -> steered: the flow label that makes the QP's packets carry the chosen port
 *
 * The port is the next of the entry's spread set for that peer (a per-peer turn counter in the
 * process), so a process's QPs to one peer take distinct paths before any path takes a second.
 */
#ifndef LINKPASS_LP_STEER_POLICY_H
#define LINKPASS_LP_STEER_POLICY_H

#include <stdint.h>

enum lps_verdict {
    LPS_STEERED,
    LPS_NOT_RTR,
    LPS_NOT_RC,
    LPS_NO_GRH,
    LPS_APP_LABEL,
    LPS_NOT_ROCE_V2,
    LPS_NO_TABLE,
    LPS_NOT_LINKPASS,
    LPS_NO_PORT,
    LPS_NVERDICTS
};
extern const char *const lps_verdict_name[LPS_NVERDICTS];

/* What the shim knows about one ibv_modify_qp call and the table, as plain facts. */
struct lps_call {
    int to_rtr;         /* attr_mask has IBV_QP_STATE and attr->qp_state == IBV_QPS_RTR */
    int rc;             /* qp->qp_type == IBV_QPT_RC */
    int grh;            /* attr_mask has IBV_QP_AV and attr->ah_attr.is_global */
    uint32_t flow_label; /* attr->ah_attr.grh.flow_label as the application set it */
    int override;       /* LINKPASS_STEER_OVERRIDE=1: replace a label the application chose */
    int roce_v2;        /* the source GID's type is RoCE v2 (sysfs gid_attrs/types) */
    int table_ok;       /* a consistent copy of a trusted table is in hand */
    int have_entry;     /* the table has an entry for the destination address */
    int nports;         /* ports in that entry's spread set (0..16) */
};

/* The guards in order; LPS_STEERED when every one passes. */
enum lps_verdict lps_judge(const struct lps_call *c);

/* The index into the spread set for a peer's `turn`-th steered QP (turn counts from 0). */
int lps_pick(int nports, uint64_t turn);

/* The destination GID as an address: 4 (IPv4-mapped ::ffff:a.b.c.d, bytes 0..3 of `addr`, the
 * rest zero) or 6 (all 16 bytes), as the entropy table keys its entries. */
int lps_gid_address(const uint8_t gid[16], uint8_t addr[16]);

#endif
