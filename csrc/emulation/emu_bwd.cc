// Emulation build of the backward translation units.
#include "../dkv_bwd_aux.cu"
#include "../dkv_bwd_hdim64.cu"
#include "../dkv_bwd_hdim96.cu"
#include "../dkv_bwd_hdim128.cu"
#include "../dkv_bwd_hdim192.cu"
#include "../dkv_bwd_hdim256.cu"
#include "../dkv_bwd_hdim512.cu"
#include "../dkv_bwd_sm90.cu"
