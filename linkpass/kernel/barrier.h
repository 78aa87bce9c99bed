/* A full CPU memory barrier for memory shared with other processes (the entropy table's seqlock).
 * x86-64: mfence or a locked instruction. aarch64: dmb ish. Python has no fences; the entropy table's Python writer and
 * reader call this through linkpass.kernel._barrier between the seqlock's steps. */
#ifndef LINKPASS_BARRIER_H
#define LINKPASS_BARRIER_H

static inline void lp_full_barrier(void) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

#endif
