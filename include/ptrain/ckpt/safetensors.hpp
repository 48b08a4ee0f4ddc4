#pragma once
// The safetensors reader and writer live in core/safetensors.hpp (a tensor file
// format that nn/models/ also reads); this header keeps the old path working.

#include "ptrain/core/safetensors.hpp"
