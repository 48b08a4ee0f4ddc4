#pragma once
// The GPT-2 weight converter lives beside its model in
// nn/models/gpt2_weights.hpp; this header keeps the old path working.

#include "ptrain/nn/models/gpt2_weights.hpp"
