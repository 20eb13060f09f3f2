/* kvengine native core: region table, scatter-gather copy jobs, mover
 * threads, completion queue signalled through one eventfd.
 *
 * C99 + POSIX, no Python.h. Every function returns an LLM status code
 * (kv_status.h) or a plain value; none blocks except kv_core_close (joins the
 * movers) and kv_core_submit when it copies inline (bounded by the inline
 * threshold).
 *
 * Rules:
 * - Every segment of a job names registered regions; offsets and lengths are
 *   checked against the region bounds at submit, before any byte moves.
 * - Movers never touch the region table: a job carries resolved addresses
 *   and holds a reference on each region it uses, so a removed region is
 *   unmapped only after the last job using it has finished.
 * - Abort is fenced: the completion of an aborted job is posted only after
 *   every mover working on it has finished its current chunk. A job's
 *   completion is posted exactly once.
 */
#ifndef KV_CORE_H
#define KV_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "kv_status.h"

#define KV_REGION_LOCAL   0 /* memory mapped in this process */
#define KV_REGION_PROCESS 1 /* memory of another process, reached with process_vm_{read,write}v */

#define KV_SEG_WORDS 5 /* a segment: src_region, src_offset, dst_region, dst_offset, nbytes */

typedef struct kv_core kv_core;

typedef struct {
    uint64_t job_id;
    uint64_t nbytes; /* bytes written into the destination */
    uint32_t status;
} kv_completion;

typedef struct {
    uint64_t jobs_submitted;  /* queued for movers */
    uint64_t jobs_inline;     /* copied on the calling thread */
    uint64_t jobs_completed;  /* completions posted */
    uint64_t jobs_aborted;
    uint64_t jobs_live;       /* queued or running */
    uint64_t bytes_moved;
    uint64_t regions_live;
    uint64_t wakeups;         /* eventfd writes */
} kv_stats;

/* Create a core with `movers` threads (1..64); `chunk_bytes` is the most a
 * mover copies between two abort checks. */
uint32_t kv_core_new(kv_core **out, int movers, uint64_t chunk_bytes);
/* The eventfd that becomes readable when completions are ready. */
int kv_core_fileno(const kv_core *core);
/* Reset the eventfd, then move up to `max` completions into `out`. */
size_t kv_core_poll(kv_core *core, kv_completion *out, size_t max);
/* Abort every job with KV_LLM_ENGINE_FINALIZED, join the movers. Idempotent.
 * Completions stay pollable until kv_core_free. */
void kv_core_close(kv_core *core);
void kv_core_free(kv_core *core);
void kv_core_stats(kv_core *core, kv_stats *out);

/* Register [addr, addr+len). With unmap_on_release the core munmaps it when the
 * region is removed and no job uses it any more. Ids are never reused. */
uint32_t kv_region_add(kv_core *core, int kind, int32_t pid, uint64_t addr, uint64_t len,
                       int unmap_on_release, uint32_t *region_id);
uint32_t kv_region_remove(kv_core *core, uint32_t region_id);

/* mmap(MAP_SHARED|MAP_POPULATE) `len` bytes of `fd`, read-write. */
uint32_t kv_map_fd(int fd, uint64_t len, uint64_t *addr);

/* Validate and start a job of `nsegs` segments (KV_SEG_WORDS words each).
 * If the job moves at most `inline_max` bytes it is copied now, on this
 * thread: *done is set to 1, the status is returned and no completion is
 * posted. Otherwise *done is 0, KV_LLM_SUCCESS is returned and a completion
 * follows. A validation failure returns its status and starts nothing.
 * A job's source and destination bytes should not overlap (same memory, within
 * one segment or across segments): movers copy chunk by chunk, concurrently, so
 * overlapping bytes come out unspecified (not checked; an inline job happens to
 * get memmove semantics per segment). */
uint32_t kv_core_submit(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                        uint64_t inline_max, int *done, uint64_t *nbytes);

/* Abort a queued or running job: its completion carries `status` (unless it
 * already failed) and is posted once no mover writes for it any more.
 * Returns KV_LLM_SUCCESS, or KV_LLM_PARAM_INVALID if the job is not live.
 * An abort that lands while the last chunks are being copied still succeeds:
 * the completion then carries `status` with nbytes up to the full size. */
uint32_t kv_core_abort(kv_core *core, uint64_t job_id, uint32_t status);

#endif
