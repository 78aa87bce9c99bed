/*
 * lp_lanes.h: the writer of a lane report (docs/lanes.md): one file per process,
 * <LINKPASS_LANES_DIR or /run/linkpass/lanes>/lanes.<pid>, naming each lane's path (peer, plane,
 * source port) and counting the bytes the peer acknowledged on it, so the agent can see which
 * paths the job uses and whether they progress. Plain C, libc only.
 *
 * Every call is a no-op while no report is open (no directory, full, closed), so callers need not
 * check. Calls are not thread-safe: the caller serializes them (the plugin: its mutex). The
 * counters (lpl_sent, lpl_acked, lpl_heartbeat) are a load and one or two stores: no syscalls.
 */
#ifndef LINKPASS_LP_LANES_H
#define LINKPASS_LP_LANES_H

#include <stdint.h>

#define LPL_DEFAULT_DIR "/run/linkpass/lanes"
#define LPL_CAPACITY 256 /* lane slots; lanes beyond them are not reported */
enum { LPL_KIND_TCP = 1, LPL_KIND_VERBS = 2 };

/* Where the report's one-line messages go (the plugin: NCCL's INFO). */
typedef void (*lpl_log_fn)(const char *msg);

/* Open this process's report. 0: reporting; -1: not (said once through log). */
int lpl_open(lpl_log_fn log);
int lpl_is_open(void);
/* Remove the report (munmap + unlink); slots handed out before are void. */
void lpl_close(void);

/* A slot for an open lane: family 4 (addr: 4 bytes) or 6 (16 bytes), network order. -1: none. */
int lpl_claim(int family, const void *addr, uint16_t plane, uint16_t sport, uint8_t kind);
void lpl_release(int slot);
/* Payload bytes handed to the lane / acknowledged by the peer (at now_ns, CLOCK_MONOTONIC). */
void lpl_sent(int slot, uint64_t bytes);
void lpl_acked(int slot, uint64_t bytes, uint64_t now_ns);
/* The writer's sign of life: at least every 100 ms while it runs. */
void lpl_heartbeat(uint64_t now_ns);

#endif
