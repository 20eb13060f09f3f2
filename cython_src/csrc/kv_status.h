/* Status codes produced by the native core: LLM-DataDist's values.
 * Defined once in kvengine/status.py; tests/test_status.py checks that every
 * value here equals the Python enum member of the same name. */
#ifndef KV_STATUS_H
#define KV_STATUS_H

#define KV_LLM_SUCCESS             0x00000000u
#define KV_LLM_FAILED              0xFFFFFFFFu
#define KV_LLM_KV_CACHE_NOT_EXIST  0x5010B002u
#define KV_LLM_PARAM_INVALID       0x5010B005u
#define KV_LLM_ENGINE_FINALIZED    0x5010B006u
#define KV_LLM_LINK_FAILED         0x5010B009u
#define KV_LLM_FEATURE_NOT_ENABLED 0x5010B019u
#define KV_LLM_TIMEOUT             0x5010B01Au
#define KV_LLM_OUT_OF_MEMORY       0x5010B01Cu
#define KV_LLM_CANCELLED           0x5010B101u

#endif
