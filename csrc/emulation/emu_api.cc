// Emulation build of the torch binding (ops torch.ops.dualkv_cuda_emu.*, CPU tensors).
#include "../dkv_api.cpp"
