/* Probe of UCX's own tcp transport (docs/security.md, "UCX links"): a peer with its
 * own UCP context (RMA, tcp only) puts 64 bytes, with an rkey of its own memory, at
 * the address of a buffer this process never exported, through an endpoint to a
 * kvengine core's UCX worker. Prints "written" if the bytes landed (UCT tcp executes
 * PUT requests unchecked: what happens when UCX_TLS names tcp), "refused" if not
 * (kvengine leaves tcp out of UCX when UCX_TLS is unset: no endpoint over tcp).
 * Run by tests/test_native_ucx.py. Both sides in one process: the peer's endpoint
 * goes over tcp loopback all the same. */
#include "kv_core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

static uint8_t canary[4096];

int main(void) {
    setvbuf(stdout, NULL, _IONBF, 0);
    memset(canary, 0xCD, sizeof canary);
    kv_core *t;
    uint8_t addr[16384];
    size_t alen = sizeof addr;
    if (kv_core_new(&t, 1, 1 << 20) || kv_ucx_address(t, addr, &alen)) {
        printf("error: no UCX worker\n");
        return 1;
    }
    ucp_config_t *cfg;
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_ep_h e;
    ucp_mem_h mh;
    ucp_rkey_h rkey;
    void *rk;
    size_t rkl;
    static uint8_t mine[4096], data[64];
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA};
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = mine, .length = sizeof mine};
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = (ucp_address_t *)addr};
    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK || ucp_config_modify(cfg, "TLS", "tcp") != UCS_OK ||
        ucp_init(&p, cfg, &ctx) != UCS_OK || ucp_worker_create(ctx, &wp, &w) != UCS_OK) {
        printf("error: attacker context\n");
        return 1;
    }
    if (ucp_ep_create(w, &ep, &e) != UCS_OK) {
        printf("refused (no endpoint over tcp)\n");
        _exit(0);
    }
    if (ucp_mem_map(ctx, &mp, &mh) != UCS_OK || ucp_rkey_pack(ctx, mh, &rk, &rkl) != UCS_OK ||
        ucp_ep_rkey_unpack(e, rk, &rkey) != UCS_OK) {
        printf("refused (no rkey usable on the endpoint)\n");
        _exit(0);
    }
    memset(data, 0x66, sizeof data);
    ucp_request_param_t rp = {.op_attr_mask = 0};
    void *r = ucp_put_nbx(e, data, sizeof data, (uint64_t)(uintptr_t)(canary + 100), rkey, &rp);
    if (UCS_PTR_IS_ERR(r)) {
        printf("refused (put: %s)\n", ucs_status_string(UCS_PTR_STATUS(r)));
        _exit(0);
    }
    void *f = ucp_ep_flush_nbx(e, &rp);
    for (long i = 0; i < 20000000 && canary[100] == 0xCD; i++) {
        ucp_worker_progress(w);
        if (f && !UCS_PTR_IS_ERR(f) && ucp_request_check_status(f) != UCS_INPROGRESS) {
            ucp_request_free(f);
            f = NULL;
            if (canary[100] == 0xCD)
                usleep(1000);
        }
    }
    printf(canary[100] == 0x66 ? "written\n" : "refused (nothing landed)\n");
    _exit(0); /* the target core is not closed: its worker still has the attacker's endpoint */
}
