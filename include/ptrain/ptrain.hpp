#pragma once
// ptrain umbrella header: every part the build enables, in layer order.

#include "ptrain/config.hpp"

#include "ptrain/core/allocator.hpp"
#include "ptrain/core/device.hpp"
#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/core/shape.hpp"
#include "ptrain/core/tensor.hpp"

#include "ptrain/ops/activation.hpp"
#include "ptrain/ops/attention.hpp"
#include "ptrain/ops/embedding.hpp"
#include "ptrain/ops/init.hpp"
#include "ptrain/ops/linear.hpp"
#include "ptrain/ops/loss.hpp"
#include "ptrain/ops/norm.hpp"

#include "ptrain/nn/activation.hpp"
#include "ptrain/nn/attention.hpp"
#include "ptrain/nn/embedding.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/nn/layer_norm.hpp"
#include "ptrain/nn/linear.hpp"
#include "ptrain/nn/loss.hpp"
#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/nn/models/mlp.hpp"
#include "ptrain/nn/module.hpp"
#include "ptrain/nn/sequential.hpp"
#include "ptrain/nn/transformer_block.hpp"

#include "ptrain/optim/adamw.hpp"
#include "ptrain/optim/clip.hpp"
#include "ptrain/optim/optimizer.hpp"
#include "ptrain/optim/schedule.hpp"
#include "ptrain/optim/sgd.hpp"

#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/launch_env.hpp"
#include "ptrain/dist/process_group.hpp"
#include "ptrain/dist/store.hpp"

#include "ptrain/parallel/ddp.hpp"
#include "ptrain/parallel/fsdp.hpp"
#include "ptrain/parallel/mesh.hpp"
#include "ptrain/parallel/pipeline.hpp"

#include "ptrain/ckpt/async_writer.hpp"
#include "ptrain/ckpt/checkpoint.hpp"
#include "ptrain/ckpt/fsdp_checkpoint.hpp"
#include "ptrain/ckpt/preemption.hpp"
#include "ptrain/ckpt/stage_checkpoint.hpp"
#include "ptrain/ckpt/safetensors.hpp"

#include "ptrain/data/batches.hpp"
#include "ptrain/data/idx.hpp"
#include "ptrain/data/sampler.hpp"
#include "ptrain/data/text.hpp"

#include "ptrain/train/metrics.hpp"
#include "ptrain/train/progress.hpp"
