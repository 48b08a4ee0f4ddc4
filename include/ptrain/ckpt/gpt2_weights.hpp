#pragma once
// Deprecated 2026-11-29: include "ptrain/nn/models/gpt2_weights.hpp" instead; removed in 0.2.0.
//
// The GPT-2 weight converter lives beside its model in
// nn/models/gpt2_weights.hpp; this header keeps the old path working.
// Nothing in ptrain includes it. It emits no warning (no #pragma message), so
// builds with -Werror keep compiling until it is removed.

#include "ptrain/nn/models/gpt2_weights.hpp"
