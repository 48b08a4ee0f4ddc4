// gpt_char compiled by nvcc: the same program, with the CUDA backend registered,
// so --device cuda runs on the GPU (and --parallel ddp/fsdp uses NCCL where the
// build has it). See gpt_char.cpp for the flags.
#include "gpt_char.cpp"
