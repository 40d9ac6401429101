// Emulation build of the forward translation units.
#include "../dkv_fwd_hdim64.cu"
#include "../dkv_fwd_hdim96.cu"
#include "../dkv_fwd_hdim128.cu"
#include "../dkv_fwd_hdim192.cu"
#include "../dkv_fwd_hdim256.cu"
#include "../dkv_fwd_hdim512.cu"
#include "../dkv_fwd_sm90.cu"
#include "../dkv_tma.cu"
