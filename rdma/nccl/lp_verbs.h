/*
 * lp_verbs.h: the I/O of the plugin's verbs lanes: one RC queue pair per lane on the RDMA device
 * that carries the plane's IPv4 address as a RoCE v2 GID, its own completion queue and channel,
 * and registered slots it sends from and receives into. No lane protocol here: lp_plugin.c puts
 * its frames into these messages and decides what they mean.
 *
 * libibverbs is loaded at run time (dlopen), so the plugin loads and runs its TCP lanes on hosts
 * without it; built without the verbs headers, lpv_setup says so and nothing else is compiled.
 *
 * Every message is copied into a registered send slot before it is posted and is received into a
 * registered receive slot, which the caller reads before the slot is posted again: a chunk is
 * placed in NCCL's buffer by the lane protocol, never by the device, so a late packet of a QP
 * that was given up cannot touch a buffer whose receive already completed.
 */
#ifndef LINKPASS_LP_VERBS_H
#define LINKPASS_LP_VERBS_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

/* What each end tells the other about its QP, in the lane's TCP handshake (little-endian). */
struct lpv_info {
    uint32_t qpn;     /* 24 bits */
    uint32_t psn;     /* 24 bits: the first packet sequence number this QP sends */
    uint8_t gid[16];  /* RoCE v2 GID (::ffff:a.b.c.d) */
    uint16_t sport;   /* the RoCEv2 UDP source port both QPs of the lane carry */
    uint8_t mtu;      /* enum ibv_mtu of the sender's port */
    uint8_t tclass;   /* traffic class (DSCP << 2) both QPs use: the send comm's */
    uint32_t nrecv;   /* receive slots posted: messages the other end may have outstanding */
};
_Static_assert(sizeof(struct lpv_info) == 32, "lpv_info is 32 bytes on the wire");

struct lpv_lane;

/* Load libibverbs and find, for each plane address, the device port whose GID table holds it as
 * RoCE v2. 0, or -1 with why (no library, no device, no such GID, a port not active). */
int lpv_setup(int nplanes, const struct in_addr *addrs, char *why, size_t n);
/* "rxe_p0 port 1 GID 3", for logs; "" before a successful setup. */
const char *lpv_describe(int plane);

/* A QP in INIT on plane's device with nsend send slots of send_size bytes and nrecv receive
 * slots of recv_size bytes, every receive slot posted. NULL with why. */
struct lpv_lane *lpv_open(int plane, uint16_t sport, size_t send_size, uint32_t nsend, size_t recv_size,
                          uint32_t nrecv, char *why, size_t n);
void lpv_local(const struct lpv_lane *v, struct lpv_info *out);
/* To RTR and RTS towards the peer's QP: the flow label makes this QP's packets carry the lane's
 * sport; ack timeout 4.096 us * 2^timeout, retry_cnt retries; RNR retried without limit. */
int lpv_connect(struct lpv_lane *v, const struct lpv_info *peer, int timeout, int retry, int tclass, char *why,
                size_t n);
/* The completion channel's fd (readable when a completion may be waiting). */
int lpv_fd(const struct lpv_lane *v);
/* Copy a (alen bytes) then b (blen) into a free send slot and post it as one SEND.
 * 0 posted, 1 no free slot (nothing done), -1 error (why). */
int lpv_send(struct lpv_lane *v, const void *a, size_t alen, const void *b, size_t blen, char *why, size_t n);
/* Take every completion: a finished send frees its slot; a received message is handed to fn
 * (msg, len), then its slot is posted again. 0, or -1 (why) when a completion failed, fn
 * returned -1, or the QP could not be fed. */
typedef int (*lpv_msg_fn)(void *arg, uint8_t *msg, size_t len);
int lpv_poll(struct lpv_lane *v, lpv_msg_fn fn, void *arg, char *why, size_t n);
/* Sends posted and not yet completed (their slots come back at lpv_poll). 0 on NULL. */
uint32_t lpv_sending(const struct lpv_lane *v);
/* Destroy the QP, its CQ, channel and slots. Safe on NULL. */
void lpv_close(struct lpv_lane *v);

#endif
