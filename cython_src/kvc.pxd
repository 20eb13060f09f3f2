# Extern declarations of csrc/kv_core.h, nothing else (uvloop includes/uv.pxd style).
from libc.stdint cimport uint16_t, uint32_t, uint64_t, int32_t

cdef extern from "kv_core.h" nogil:
    int KV_REGION_LOCAL
    int KV_REGION_PROCESS
    int KV_REGION_TCP
    int KV_REGION_UCX
    int KV_SEG_WORDS
    int KV_SEG2_WORDS
    unsigned int KV_LLM_PARAM_INVALID  # kv_status.h, checked against status.py by tests/test_status.py
    unsigned int KV_LLM_ENGINE_FINALIZED
    unsigned int KV_LLM_FEATURE_NOT_ENABLED
    unsigned KV_REGION_F_UNMAP
    unsigned KV_REGION_F_EXPORT
    unsigned KV_DONE_UNSTARTED
    unsigned KV_INLINE_REFUSED
    unsigned KV_REGION_F_NOTIFY
    unsigned long long KV_EVENT
    unsigned long long KV_EVENT_LINK_READY
    unsigned long long KV_EVENT_LINK_DOWN
    unsigned long long KV_EVENT_REGION_FREED
    unsigned long long KV_EVENT_ID_MASK
    unsigned long long KV_EVENT_KIND_MASK
    int KV_MAX_STREAMS
    int KV_TOKEN_BYTES

    ctypedef struct kv_core:
        pass

    ctypedef struct kv_completion:
        uint64_t job_id
        uint64_t nbytes
        uint32_t status
        uint32_t flags

    ctypedef struct kv_stats:
        uint64_t jobs_submitted
        uint64_t jobs_inline
        uint64_t jobs_completed
        uint64_t jobs_aborted
        uint64_t jobs_live
        uint64_t bytes_moved
        uint64_t regions_live
        uint64_t wakeups
        uint64_t tcp_conns
        uint64_t tcp_bytes_sent
        uint64_t tcp_bytes_received
        uint64_t tcp_bad_frames
        uint64_t tcp_refused
        uint64_t tcp_links_failed
        uint64_t tcp_lease_expired
        uint64_t tcp_fence_expired
        uint64_t tcp_stalled
        uint64_t tcp_accept_paused
        uint64_t ucx_bad_msgs
        uint64_t ucx_refused
        uint64_t ucx_dropped
        uint64_t ucx_bytes_sent
        uint64_t ucx_bytes_received
        uint64_t ucx_lease_grants
        uint64_t ucx_late_dropped
        uint64_t ucx_rx_pending
        uint64_t ucx_rx_orphans
        uint64_t ucx_stage_bytes
        uint64_t ucx_rx_staged
        uint64_t ucx_rx_rows
        uint64_t ucx_land_pread
        uint64_t ucx_land_pvw
        uint64_t ucx_ep_closes
        uint64_t ucx_ep_closing
        uint64_t ucx_ep_kept
        uint64_t ucx_ep_parked
        uint64_t ucx_driven
        uint64_t ucx_drive_handed
        uint64_t tcp_driven
        uint64_t tcp_drive_handed
        uint64_t jobs_abandoned
        uint64_t movers_stuck
        uint64_t chunks_paired
        uint64_t tcp_row_reads
        uint64_t tcp_readv
        uint64_t ucx_row_pulls
        uint64_t ucx_pullv
        uint64_t ucx_pushv

    uint32_t kv_core_new(kv_core **out, int movers, uint64_t chunk_bytes)
    int kv_core_fileno(const kv_core *core)
    size_t kv_core_poll(kv_core *core, kv_completion *out, size_t max)
    int kv_core_wait_take(kv_core *core, uint64_t job_id, uint64_t bound_ns, kv_completion *out)
    void kv_core_close(kv_core *core)
    void kv_core_free(kv_core *core)
    void kv_core_stats(kv_core *core, kv_stats *out)
    uint32_t kv_region_add(kv_core *core, int kind, int32_t pid, uint64_t addr, uint64_t len,
                           unsigned flags, uint32_t *region_id)
    uint32_t kv_region_remove(kv_core *core, uint32_t region_id)
    uint32_t kv_region_pidfd(kv_core *core, uint32_t region_id, int pidfd, uint64_t key)
    uint32_t kv_map_fd(int fd, uint64_t len, uint64_t *addr)
    int kv_populate_write(void *addr, uint64_t len)
    uint32_t kv_core_submit(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                            uint64_t inline_max, int *done, uint64_t *nbytes)
    uint32_t kv_core_submit_ranked(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                                   uint64_t inline_max, uint64_t rank, int *done, uint64_t *nbytes)
    uint32_t kv_core_abort(kv_core *core, uint64_t job_id, uint32_t status)
    size_t kv_core_reap(kv_core *core, uint64_t bound_ns, uint64_t *ids, size_t max)
    uint32_t kv_lease_add(kv_core *core, uint64_t until_ns, uint32_t *lease_id)
    uint32_t kv_lease_renew(kv_core *core, uint32_t lease_id, uint64_t until_ns)
    uint32_t kv_lease_remove(kv_core *core, uint32_t lease_id)
    int kv_lease_busy(kv_core *core, uint32_t lease_id)
    uint32_t kv_core_submit_leased(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                                   uint64_t inline_max, uint64_t rank, uint32_t lease_id, int *done,
                                   uint64_t *nbytes)
    uint32_t kv_core_submit_job(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                                unsigned words, uint64_t inline_max, uint64_t rank, uint32_t lease_id,
                                int *done, uint64_t *nbytes)
    uint32_t kv_tcp_listen(kv_core *core, const char *ip, uint16_t port, uint16_t *bound_port)
    uint32_t kv_tcp_link_add(kv_core *core, uint32_t link_id, const unsigned char *token, int nstreams,
                             uint64_t window, uint64_t lease_ns, uint64_t fence_ns, uint64_t margin_ns)
    uint32_t kv_tcp_conn_add(kv_core *core, int fd, uint32_t link_id)
    uint32_t kv_tcp_link_close(kv_core *core, uint32_t link_id, uint32_t status)
    int kv_ucx_available()
    uint32_t kv_ucx_address(kv_core *core, unsigned char *out, size_t *len)
    int KV_UCX_TOKEN
    unsigned KV_UCX_PEER_PULL2D
    unsigned KV_UCX_PEER_PULLV
    unsigned KV_UCX_PEER_PUSHV
    uint32_t kv_ucx_mem_map(kv_core *core, uint32_t region_id)
    uint32_t kv_ucx_link_add(kv_core *core, uint32_t link_id, const unsigned char *addr, size_t len,
                             const unsigned char *rx_token, const unsigned char *tx_token,
                             uint64_t window, uint64_t lease_ns, uint64_t fence_ns, uint64_t margin_ns,
                             unsigned peer_flags)
    uint32_t kv_ucx_link_close(kv_core *core, uint32_t link_id, uint32_t status)
    int kv_ucx_submit_driven(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs, uint32_t lease,
                             uint64_t bound_ns, kv_completion *out, uint32_t *status) nogil
    int kv_tcp_submit_driven(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs, uint32_t lease,
                             uint64_t bound_ns, kv_completion *out, uint32_t *status) nogil
    uint32_t kv_ucx_test_send(kv_core *core, uint32_t link_id, const unsigned char *hdr, size_t hdr_len,
                              const unsigned char *data, size_t data_len, int rndv)
