#pragma once
// Deprecated 2026-11-29: include "ptrain/core/safetensors.hpp" instead; removed in 0.2.0.
//
// The safetensors reader and writer live in core/safetensors.hpp (a tensor file
// format that nn/models/ also reads); this header keeps the old path working.
// Nothing in ptrain includes it. It emits no warning (no #pragma message), so
// builds with -Werror keep compiling until it is removed.

#include "ptrain/core/safetensors.hpp"
