// Trains a character-level GPT on plain text and prints validation loss and a sample.
//
//   build/examples/gpt_char                                   # the fortunes corpus, single process
//   build/examples/gpt_char --data input.txt --steps 5000     # any plain-text file
//   mpirun -np 2 build/examples/gpt_char --parallel ddp       # data parallel (also under ptrun)
//   ptrun --nproc-per-node 2 gpt_char --parallel fsdp          # fully sharded (--fsdp-strategy ...)
//   ptrun --nproc-per-node 4 gpt_char --parallel pipeline --stages 2 --micro-batches 4   # 2 replicas x 2 stages
//   ptrun --nproc-per-node 2 gpt_char --parallel ddp --batch 8 --grad-accum 4   # 64 sequences per step
//
// Checkpoints, with the flags and behaviour of fashion_mnist: --checkpoint-dir DIR
// saves every --checkpoint-every steps (in the background), at the end, and when
// SIGTERM/SIGINT/SIGUSR1 arrives (all ranks agree at the next step, save and exit
// with --preempt-exit-code); --resume continues from the newest complete checkpoint
// in DIR when there is one, bit for bit on the same ranks and flags
// (docs/models.md, docs/checkpointing.md). Checkpoints of every mode hold the
// same tensor names, so a run of any mode and world size resumes any of them
// (a pipeline trains an untied model: resume its checkpoints elsewhere with --untied):
//   ptrun --nproc-per-node 2 gpt_char --parallel ddp --checkpoint-dir ckpt --checkpoint-every 250 --resume
//   ptrun --nproc-per-node 4 gpt_char --parallel fsdp --checkpoint-dir ckpt --checkpoint-every 250 --resume
// --export FILE writes the final parameters, whole, to one safetensors file.
//
// --precision bf16 trains a bf16 model (bf16 parameters and activations, fp32
// master weights and moments in AdamW; docs/models.md). --device cuda runs on
// the GPU of the rank's LOCAL_RANK, with NCCL between ranks: it needs the build
// of this file by nvcc, gpt_char_cuda (PTRAIN_WITH_CUDA=ON):
//   gpt_char_cuda --device cuda --precision bf16 --batch 64 --block 256 --layers 6 --embd 384
//   torchrun --nproc-per-node 8 gpt_char_cuda --device cuda --precision bf16 --parallel fsdp
//
// Data: Debian's `fortunes` package (/usr/share/games/fortunes, about 2.5 MB of
// English): every fortune file, in name order, without the "%" separator lines.
// The last 10% of the characters are the validation split. Or pre-tokenized
// files, nanoGPT's train.bin/val.bin or llm.c's shards, mapped rather than read:
//   gpt_char --train-tokens 'data/fineweb_train_*.bin' --val-tokens 'data/fineweb_val_*.bin' --vocab-size 50304
// --tokenizer DIR (GPT-2's vocab.json + merges.txt) tokenizes --data with GPT-2's BPE
// instead of characters, and encodes --prompt and decodes the sample of token files;
// with --init-from, nanoGPT's fine-tuning of GPT-2 on a text:
//   gpt_char --data input.txt --tokenizer gpt2 --init-from gpt2/model.safetensors --block 256 --layers 12 --heads 12 --embd 768
// Metrics (--metrics) are JSON lines; evaluation lines carry val_loss and
// unigram_entropy (nats per token: the loss of the best context-free model).
//
// The state a checkpoint needs is all in TrainState below: step, the train
// windows' position, the dropout streams' offsets (model.generators()), the
// parameters and the optimizer state; the LR schedule is a function of the step.
// Note [gpt_char resume state] in main() says how each is saved and restored.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <ptrain/ckpt/async_writer.hpp>
#include <ptrain/ckpt/checkpoint.hpp>
#include <ptrain/ckpt/fsdp_checkpoint.hpp>
#include <ptrain/nn/models/gpt2_weights.hpp>
#include <ptrain/ckpt/preemption.hpp>
#include <ptrain/ckpt/stage_checkpoint.hpp>
#include <ptrain/data/bpe.hpp>
#include <ptrain/data/text.hpp>
#include <ptrain/dist/launch_env.hpp>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/parallel/ddp.hpp>
#include <ptrain/parallel/fsdp.hpp>
#include <ptrain/parallel/mesh.hpp>
#include <ptrain/parallel/pipeline.hpp>
#include <ptrain/ptrain.hpp>

#include "checkpoint_flags.hpp"

using namespace ptrain;

namespace {

constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

struct Options {
  std::string data;  // empty: the fortunes corpus
  std::vector<std::string> train_tokens, val_tokens;  // token files instead of text (paths or glob patterns)
  std::string token_format = "u16";
  std::int64_t vocab_size = 0;  // of the token files (0: the tokenizer's)
  std::string tokenizer;         // GPT-2 BPE folder; empty: characters (text) or none (token files)
  std::string parallel = "none";
  std::string device = "cpu";
  std::string precision = "fp32";
  std::string fsdp_strategy = "full_shard";
  int hybrid_shard_size = 0;  // 0: the launcher's ranks per node
  int stages = 0;             // --parallel pipeline: stages per replica (0: every rank one stage)
  int micro_batches = 4;
  std::string schedule = "1f1b";
  bool untied = false;        // the LM head has its own weight (always under --parallel pipeline)
  bool recompute = false;     // activation checkpointing of every block
  std::int64_t steps = 1500;
  std::int64_t batch = 16;  // per replica: a rank, or the stages of one pipeline
  int grad_accum = 1;       // batches whose gradients add up to one optimizer step (not under pipeline)
  std::int64_t block = 128;
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  double dropout = 0.0;
  double lr = 2e-3;
  double min_lr = 2e-4;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  std::int64_t warmup = 100;
  std::int64_t eval_every = 250;
  std::int64_t eval_batches = 16;
  std::uint64_t seed = 1337;
  std::string metrics;
  std::int64_t log_every = 50;
  std::int64_t sample_tokens = 300;
  double temperature = 0.8;
  std::int64_t top_k = 20;
  std::string prompt = "The ";
  std::string save_tokenizer;
  int threads = 0;  // 0: OpenBLAS's default alone, 1 per rank under --parallel ddp/fsdp
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;
  int keep_checkpoints = 3;
  int preempt_exit_code = 0;
  bool resume = false;
  std::string export_path;
  std::string export_hf;  // Hugging Face GPT-2 folder
  std::string init_from;  // pretrained weights: Hugging Face GPT-2 or ptrain names
};

// The fortune files of Debian's `fortunes` package, concatenated in name order.
std::string fortunes_corpus() {
  namespace fs = std::filesystem;
  PTRAIN_CHECK(fs::is_directory(kFortunesDir), DataError, "[ptrain.example.fortunes] ", kFortunesDir,
               " is missing; install the corpus with `apt-get install fortunes`, or pass --data FILE");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(kFortunesDir))
    if (e.is_regular_file() && !e.is_symlink() && e.path().extension() != ".dat") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string out;
  for (const auto& f : files) {
    const std::string text = read_text_file(f.string());
    std::size_t pos = 0;
    while (pos < text.size()) {
      std::size_t end = text.find('\n', pos);
      end = end == std::string::npos ? text.size() : end + 1;
      const std::string_view line(text.data() + pos, end - pos);
      if (line != "%\n" && line != "%") out.append(line);
      pos = end;
    }
  }
  return out;
}

// What the run trains and validates on: a text (the fortunes, or --data) as
// characters or as GPT-2 BPE tokens (--tokenizer), the last 10% for validation; or
// token files (--train-tokens, --val-tokens), mapped and read where the windows fall.
struct Corpus {
  std::optional<CharTokenizer> chars;  // a text without --tokenizer
  std::optional<BpeTokenizer> bpe;     // --tokenizer
  TokenCorpus train, val;
  std::int64_t vocab_size;
  double entropy;  // unigram entropy (nats per token): of the whole text, or of the validation files
  std::string describe;

  bool can_encode() const { return chars || bpe; }  // token files without --tokenizer cannot
  std::vector<std::int32_t> encode(std::string_view text) const {
    return chars ? chars->encode(text) : bpe->encode(text);
  }
  std::string decode(const std::vector<std::int32_t>& ids) const { return chars ? chars->decode(ids) : bpe->decode(ids); }
};

Corpus load_corpus(const Options& o) {
  std::optional<BpeTokenizer> bpe;
  std::int64_t vocab = o.vocab_size;
  if (!o.tokenizer.empty()) {
    bpe = BpeTokenizer::load(o.tokenizer);
    const std::int64_t padded = (bpe->vocab_size() + 63) / 64 * 64;
    PTRAIN_CHECK(vocab == 0 || vocab >= bpe->vocab_size(), DataError, "[gpt_char.vocab] --vocab-size ", vocab,
                 " is smaller than the tokenizer's ", bpe->vocab_size(), " ids; pass at least that (e.g. ", padded,
                 ") or leave it out");
    if (vocab == 0) vocab = bpe->vocab_size();
  }
  if (!o.train_tokens.empty()) {
    const TokenFormat f = o.token_format == "i32" ? TokenFormat::I32 : TokenFormat::U16;
    TokenCorpus train = TokenCorpus::open(glob_paths(o.train_tokens), f);
    TokenCorpus val = TokenCorpus::open(glob_paths(o.val_tokens), f);
    const double entropy = unigram_entropy(val, vocab);  // also checks every validation id
    const std::string what = "token files: train " + train.describe() + ", validation " + val.describe();
    return {std::nullopt, std::move(bpe), std::move(train), std::move(val), vocab, entropy, what};
  }
  const std::string text = o.data.empty() ? fortunes_corpus() : read_text_file(o.data);
  std::string what = "corpus " + (o.data.empty() ? std::string(kFortunesDir) : o.data) + ": ";
  std::optional<CharTokenizer> chars;
  Tensor<std::int32_t> ids;
  if (bpe) {
    ids = bpe->encode_tensor(text);
    what += std::to_string(text.size()) + " bytes, " + std::to_string(ids.numel()) + " GPT-2 BPE tokens";
  } else {
    chars = CharTokenizer::fit(text);
    ids = chars->encode_tensor(text);
    vocab = chars->vocab_size();
    what += std::to_string(ids.numel()) + " characters";
  }
  const std::int64_t n = ids.numel(), n_val = n / 10;
  const double entropy = unigram_entropy(ids, vocab);
  return {std::move(chars), std::move(bpe), ids.narrow(0, n - n_val), ids.narrow(n - n_val, n_val), vocab, entropy,
          what};
}

// Everything a checkpoint must capture to resume this loop exactly.
template <class T>
struct TrainState {
  std::int64_t step = 0;
  RandomWindows* windows = nullptr;  // position() = batches taken (by each rank of a replica)
  nn::GPT<T>* model = nullptr;       // parameters; model->generators() = dropout stream offsets
  optim::AdamW<T>* optimizer = nullptr;
};

// The flags that fix the parameters' meaning, keyed by flag name ("vocab" comes
// from --data). --heads changes no tensor shape, so only this check catches it.
nlohmann::json model_flags(const nn::GPTConfig& c, const Options& o) {
  return {{"vocab", c.vocab_size}, {"block", c.block_size}, {"layers", c.n_layer}, {"heads", c.n_head},
          {"embd", c.n_embd}, {"precision", o.precision}, {"untied", !c.tie_weights}};
}

// --parallel with its options: "none", "ddp", "fsdp full_shard", "fsdp hybrid 2",
// "pipeline 2 stages x 2 replicas, m 4, 1f1b".
std::string parallel_layout(const Options& o, int world) {
  if (o.parallel == "pipeline") {
    const int pp = o.stages > 0 ? o.stages : world;
    return "pipeline " + std::to_string(pp) + " stages x " + std::to_string(world / pp) + " replicas, m " +
           std::to_string(o.micro_batches) + ", " + o.schedule;
  }
  if (o.parallel != "fsdp") return o.parallel;
  return "fsdp " + o.fsdp_strategy + (o.fsdp_strategy == "hybrid" ? " " + std::to_string(o.hybrid_shard_size) : "");
}

// Flags that a resumed run may change (the run goes on, but is no longer the
// bit-exact continuation); keyed by flag name too.
nlohmann::json train_flags(const Options& o, int world) {
  return {{"seed", o.seed},   {"batch", o.batch},   {"dropout", o.dropout},     {"steps", o.steps},
          {"lr", o.lr},       {"min-lr", o.min_lr}, {"warmup", o.warmup},       {"weight-decay", o.weight_decay},
          {"grad-clip", o.grad_clip}, {"parallel", parallel_layout(o, world)}, {"grad-accum", o.grad_accum}};
}

// Refuses a checkpoint of another program or model before any tensor is read,
// naming every flag that differs; returns the training flags that differ (for a note).
std::string check_checkpoint_config(const nlohmann::json& user, const nlohmann::json& model,
                                    const nlohmann::json& train, const std::string& path) {
  const std::string program = user.is_object() ? user.value("program", std::string()) : std::string();
  PTRAIN_CHECK(program == "gpt_char" && user.contains("model") && user["model"].is_object(), CheckpointError,
               "[ptrain.example.config] ", path, " was not written by gpt_char (program '", program,
               "'); pass another --checkpoint-dir");
  std::string model_diff;
  for (const auto& [key, want] : model.items()) {
    // Checkpoints from before --precision and --untied existed are fp32 and tied.
    const nlohmann::json old = key == "precision" ? nlohmann::json("fp32")
                               : key == "untied"  ? nlohmann::json(false)
                                                  : nlohmann::json();
    const nlohmann::json have = user.at("model").value(key, old);
    if (have == want) continue;
    model_diff += (key == "vocab" ? "; vocabulary size " : "; --" + key + " ") + have.dump() + " in the checkpoint, " +
                  want.dump() + (key == "vocab" ? " from the data now" : " now") +
                  (key == "untied" ? " (--parallel pipeline always trains an untied model)" : "");
  }
  PTRAIN_CHECK(model_diff.empty(), CheckpointError, "[ptrain.example.config] ", path,
               " holds another model than the flags describe", model_diff,
               ". Pass the checkpoint's values to resume it, or another --checkpoint-dir (or no --resume) to start "
               "a new run");
  std::string train_diff;
  const nlohmann::json saved = user.value("train", nlohmann::json::object());
  for (const auto& [key, want] : train.items()) {
    // Checkpoints from before --grad-accum existed took one batch per step.
    const nlohmann::json have = saved.value(key, key == "grad-accum" ? nlohmann::json(1) : nlohmann::json());
    auto str = [](const nlohmann::json& j) { return j.is_string() ? j.get<std::string>() : j.dump(); };
    if (have != want)
      train_diff += (train_diff.empty() ? "--" : ", --") + key + " " + str(want) + " (checkpoint: " +
                    (have.is_null() ? "not recorded" : str(have)) + ")";
  }
  return train_diff;
}

// Mean loss over eval_batches fixed windows of the validation split (eval mode).
// `batch_loss` is the loss of one batch: by the model, its FSDP wrapper or the pipeline (the last two collective).
template <class T, class BatchLoss>
double evaluate(nn::GPT<T>& model, RandomWindows& windows, std::int64_t batches, std::int64_t batch,
                BatchLoss&& batch_loss) {
  model.train(false);
  Tensor<std::int32_t> x, y;
  windows.set_position(0);
  double total = 0;
  for (std::int64_t b = 0; b < batches; ++b) {
    windows.next(batch, x, y);
    total += batch_loss(x, y);
  }
  model.train(true);
  return total / static_cast<double>(batches);
}

// The cost of each GPT unit for partition_balanced: forward matmul FLOPs per token
// (the embedding's lookup counts one per channel).
std::vector<double> unit_costs(const nn::GPTConfig& c) {
  const auto C = static_cast<double>(c.n_embd), S = static_cast<double>(c.block_size);
  std::vector<double> cost{C};
  for (std::int64_t l = 0; l < c.n_layer; ++l) cost.push_back(24 * C * C + 4 * S * C);
  cost.push_back(2 * C * static_cast<double>(c.vocab_size));
  return cost;
}

}  // namespace

// The training run in element type T (float, or bf16 with --precision bf16).
template <class T>
int run(Options opt) {
  try {
    Stopwatch wall;
    // cuda: the GPU of this rank's LOCAL_RANK (0 without a launcher), NCCL between ranks.
    PTRAIN_CHECK(opt.device == "cpu" || ptrain::detail::cuda_backend_slot(), Error, "[ptrain.example.device] "
                 "--device cuda needs gpt_char_cuda, this program compiled by nvcc (cmake -DPTRAIN_WITH_CUDA=ON)");
    const Device device = opt.device == "cuda" ? Device::cuda(dist::detect_launch_env().local_rank) : Device::cpu();
    std::unique_ptr<dist::Communicator> comm;
    if (opt.parallel != "none") comm = dist::init_process_group({.device = device});
    const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
    const bool lead = rank == 0;
    // pipeline: a dp x pp mesh; the stages of one replica read the same batches.
    std::unique_ptr<parallel::Mesh> mesh;
    if (opt.parallel == "pipeline") {
      const int pp = opt.stages > 0 ? opt.stages : world;
      PTRAIN_CHECK(world % pp == 0, Error, "[gpt_char.stages] --stages ", pp, " does not divide the ", world,
                   " ranks; launch a multiple of --stages ranks (each group of --stages ranks is one replica)");
      PTRAIN_CHECK(opt.grad_accum == 1, Error, "[gpt_char.grad_accum] --parallel pipeline accumulates its "
                   "--micro-batches already; instead of --grad-accum ", opt.grad_accum, " multiply --batch and "
                   "--micro-batches by ", opt.grad_accum);
      PTRAIN_CHECK(opt.batch % opt.micro_batches == 0, Error, "[gpt_char.micro_batches] --batch ", opt.batch,
                   " is not divisible by --micro-batches ", opt.micro_batches, "; pick a multiple");
      PTRAIN_CHECK(opt.n_layer + 2 >= pp, Error, "[gpt_char.stages] ", pp, " stages for ", opt.n_layer + 2,
                   " units (embedding, ", opt.n_layer, " blocks, head); use at most ", opt.n_layer + 2, " stages");
      mesh = std::make_unique<parallel::Mesh>(*comm, world / pp, pp);
    }
    const int replicas = mesh ? mesh->dp_size() : world, replica = mesh ? mesh->replica() : rank;
    // Ranks of one node would oversubscribe the cores with a thread pool each.
    if (opt.threads > 0 || comm) kernels::cpu::set_num_threads(opt.threads > 0 ? opt.threads : 1);

    const Corpus corpus = load_corpus(opt);
    const double entropy = corpus.entropy;
    if (lead && corpus.chars && !opt.save_tokenizer.empty()) corpus.chars->save(opt.save_tokenizer);
    // What the end of the run needs, checked before training: the prompt's tokens, the export's folder.
    if (corpus.can_encode() && opt.sample_tokens > 0)
      PTRAIN_CHECK(!corpus.encode(opt.prompt).empty(), Error, "[gpt_char.prompt] --prompt is empty; give the "
                   "sample some text to continue");
    if (const auto folder = std::filesystem::path(opt.export_path).parent_path(); lead && !folder.empty())
      PTRAIN_CHECK(std::filesystem::is_directory(folder), Error, "[gpt_char.export] folder ", folder.string(),
                   " of --export does not exist; create it or choose another path");
    if (const auto folder = std::filesystem::path(opt.export_hf).parent_path(); lead && !folder.empty())
      PTRAIN_CHECK(std::filesystem::is_directory(folder), Error, "[gpt_char.export] folder ", folder.string(),
                   " of --export-hf does not exist; create it or choose another path");
    RandomWindows train_windows(corpus.train, opt.block, opt.seed, replica, replicas, corpus.vocab_size);
    RandomWindows val_windows(corpus.val, opt.block, opt.seed + 1, 0, 1, corpus.vocab_size);

    manual_seed(opt.seed);
    nn::GPTConfig cfg{.vocab_size = corpus.vocab_size, .block_size = opt.block, .n_layer = opt.n_layer,
                      .n_head = opt.n_head, .n_embd = opt.n_embd, .dropout = opt.dropout,
                      .tie_weights = !opt.untied && !mesh, .dropout_seed = opt.seed + static_cast<std::uint64_t>(rank),
                      .recompute = opt.recompute};
    nn::GPT<T> model(cfg);
    // Checkpoints (optional), found first: a checkpoint to resume replaces --init-from's weights.
    std::unique_ptr<ckpt::CheckpointManager> checkpoints;
    ckpt::LatestCheckpoint last;
    if (!opt.checkpoint_dir.empty()) {
      checkpoints = std::make_unique<ckpt::CheckpointManager>(
          opt.checkpoint_dir, comm.get(), ckpt::CheckpointOptions{.keep_last = opt.keep_checkpoints});
      if (opt.resume) last = checkpoints->latest();
    }
    if (!opt.init_from.empty() && !last.found()) {
      const std::string loaded = ckpt::load_gpt2_weights(opt.init_from, model);
      if (lead) std::printf("initialised from %s: %s\n", opt.init_from.c_str(), loaded.c_str());
    }
    // Initialised on the CPU, so every device starts from the same values; a pipeline stage moves
    // its own units, and FSDP its shards (the GPU never holds the whole model).
    if (!device.is_cpu() && !mesh && opt.parallel != "fsdp") model.to(device);
    const std::int64_t num_parameters = model.num_parameters();  // FSDP releases the model's tensors
    // none/ddp: the parameters packed in one flat buffer (DDP's buckets are ranges of it).
    // fsdp: every unit (embedding, blocks, head) is sharded under the model's own
    // parameter names, so checkpoints of all modes hold the same tensors.
    // pipeline: every rank builds the whole model in host memory (one initialisation
    // stream, so every stage starts as the one-process model does) and keeps the
    // units of its stage, under the model's names; stages balance forward FLOPs.
    std::unique_ptr<nn::FlatParameters<T>> params;
    std::unique_ptr<parallel::DDP<T>> ddp;
    std::unique_ptr<parallel::FSDP<T>> fsdp;
    std::unique_ptr<parallel::Pipeline<T>> pipe;
    if (mesh) {
      auto unit = [&](std::size_t u) {
        auto m = model.units()[u];
        if (!device.is_cpu()) m->to(device);
        return m;
      };
      const auto part = parallel::partition_balanced(unit_costs(cfg), mesh->pp_size());
      pipe = std::make_unique<parallel::Pipeline<T>>(
          mesh->pipeline_group(), model.units().size(), unit, part,
          parallel::PipelineOptions<T>{.schedule = opt.schedule == "gpipe" ? parallel::Schedule::GPipe
                                                                           : parallel::Schedule::OneFOneB,
                                       .micro_batches = opt.micro_batches, .unit_names = model.unit_names(),
                                       .data_parallel = &mesh->data_group()});
    } else if (opt.parallel == "fsdp") {
      if (opt.fsdp_strategy == "hybrid" && opt.hybrid_shard_size == 0)
        opt.hybrid_shard_size = dist::detect_launch_env().local_world_size;
      parallel::FSDPOptions fo{
          .hybrid_shard_size = opt.hybrid_shard_size, .unit_names = model.unit_names(), .device = device};
      for (auto st : {parallel::ShardingStrategy::FullShard, parallel::ShardingStrategy::ShardGradOp,
                      parallel::ShardingStrategy::ShardOptimizer, parallel::ShardingStrategy::NoShard,
                      parallel::ShardingStrategy::Hybrid})
        if (opt.fsdp_strategy == parallel::strategy_name(st)) fo.strategy = st;
      fsdp = std::make_unique<parallel::FSDP<T>>(model.units(), *comm, fo);
    } else {
      params = std::make_unique<nn::FlatParameters<T>>(model);
      if (comm) ddp = std::make_unique<parallel::DDP<T>>(model, *params, *comm);
    }
    // The same options and decay filter in every mode: FSDP's local entries carry
    // the parameter names (1-D pieces of them), and the filter decides by name.
    const optim::AdamWOptions adamw{.lr = opt.lr, .beta2 = 0.99, .weight_decay = opt.weight_decay};
    optim::AdamW<T> optimizer = [&] {
      if (fsdp)
        return optim::AdamW<T>(fsdp->local_values(), fsdp->local_grads(), fsdp->local_entries(), adamw,
                                   nn::gpt_decay_filter());
      return optim::AdamW<T>(pipe ? pipe->parameters() : *params, adamw, nn::gpt_decay_filter());
    }();
    nn::Module<T>& net = ddp ? static_cast<nn::Module<T>&>(*ddp)
                                 : fsdp ? static_cast<nn::Module<T>&>(*fsdp) : model;
    // Per-mode pieces of the loop; everything else is shared.
    auto zero_grad = [&] { fsdp ? fsdp->zero_grad() : params->zero_grad(); };
    auto average = [&](double v) {  // the same all-reduce as DDP::average
      if (comm) comm->all_reduce(&v, 1, DType::F64, dist::ReduceOp::Avg);
      return v;
    };
    auto clip = [&] {  // FSDP: collective over the shards, each holding part of the gradient
      if (opt.grad_clip <= 0) return 0.0;
      if (fsdp) return fsdp->clip_grad_norm_(opt.grad_clip);
      if (!pipe) return optim::clip_grad_norm_(params->grads(), opt.grad_clip);
      // The stages of a replica hold disjoint parts of the (replica-averaged) gradient.
      return optim::clip_grad_norm_(pipe->parameters().grads(), opt.grad_clip, [&](double sq) {
        mesh->pipeline_group().all_reduce(&sq, 1, DType::F64, dist::ReduceOp::Sum);
        return sq;
      });
    };
    nn::CrossEntropyLoss<T> ce;
    const optim::WarmupCosine schedule{.base_lr = opt.lr, .warmup = opt.warmup, .total = opt.steps,
                                       .min_lr = opt.min_lr};

    TrainState<T> state{0, &train_windows, &model, &optimizer};
    // Resume before training, so that metrics append to the resumed run's file.
    std::unique_ptr<ckpt::AsyncCheckpointer> saver;
    if (checkpoints) saver = std::make_unique<ckpt::AsyncCheckpointer>(*checkpoints);
    std::int64_t last_saved = -1;
    bool resumed = false;
    // Note [gpt_char resume state]
    // - Data: every rank takes --grad-accum batches per step (pipeline: one), so each
    //   rank's position() is a multiple of the step, and replica r's batch at position t is global windows
    //   (t*replicas + r)*batch + j (a replica is one rank, or the stages of one
    //   pipeline, which read the same batch): one number describes every stream,
    //   and no per-rank positions need gathering. It is saved as the global
    //   windows consumed (SamplerState::consumed = position*replicas*batch), so a
    //   resume on another world size or batch starts at the first batch that
    //   repeats no window.
    // - Dropout: rank r's streams are seeded from --seed + r (GPTConfig::dropout_seed)
    //   and every rank draws the same count per step (same shapes), so rank 0's
    //   offsets are every rank's; rng["dropout/<name>"] holds them, and each rank
    //   keeps its own seed and takes the offset. In a pipeline each stream is
    //   drawn on one stage only, and the other stages' copies stay where they
    //   started (0, or the resumed offset): the largest offset over the stages of
    //   a replica is the stream's.
    // - Parameters, AdamW moments and step count: model/optimizer.safetensors and
    //   trainer.json (written by rank 0: DDP replicas are identical). The LR is
    //   schedule(step) of the flags' schedule; trainer.json keeps it for reference.
    //   Under fsdp each rank writes the pieces of parameters and moments in its shard
    //   (model-RRRRR-of-WWWWW.safetensors, save_sharded), under the same names;
    //   load_fsdp reshards any checkpoint (also save()'s) onto this run's shards, and
    //   CheckpointManager::load assembles whole tensors from pieces for none/ddp.
    //   Under pipeline, replica 0 of each stage writes its stage's tensors whole
    //   (save_stage); load_stage resumes the same layout, and a checkpoint of
    //   another mode or layout loads the stage's tensors by name.
    const nlohmann::json model_cfg = model_flags(cfg, opt), train_cfg = train_flags(opt, world);
    if (opt.resume) {
      for (const auto& s : last.skipped)
        if (lead) std::fprintf(stderr, "gpt_char: skipping %s: %s\n", s.path.c_str(), s.reason.c_str());
      if (last.found()) {
        // The config check reads only trainer.json, so a mismatch leaves the model untouched.
        const ckpt::TrainerState saved = ckpt::Checkpoint(last.path, false).trainer_state();
        std::string changed = check_checkpoint_config(saved.user, model_cfg, train_cfg, last.path.string());
        const ckpt::TrainerState st = [&] {
          if (fsdp) return ckpt::load_fsdp(last.path, *fsdp, &optimizer);
          if (!pipe) return checkpoints->load(last.path, *params, &optimizer);
          if (ckpt::same_pipeline_layout(ckpt::saved_pipeline_layout(saved), *pipe))
            return ckpt::load_stage(*checkpoints, last.path, *pipe, &optimizer);
          // Another mode or another cut: this stage's tensors by name.
          return checkpoints->load(last.path, pipe->parameters(), &optimizer, ckpt::LoadOptions{.partial = true});
        }();
        PTRAIN_CHECK(st.sampler.has_value(), CheckpointError, "[ptrain.example.config] ", last.path.string(),
                     " has no data position; it was not written by this program");
        const auto windows_per_step = static_cast<std::int64_t>(replicas) * opt.batch;
        train_windows.set_position((st.sampler->consumed + windows_per_step - 1) / windows_per_step);
        for (auto& [name, gen] : model.generators()) {
          const auto it = st.rng.find("dropout/" + name);
          PTRAIN_CHECK(it != st.rng.end(), CheckpointError, "[ptrain.example.config] ", last.path.string(),
                       " has no offset for dropout stream '", name, "'; it was not written by this program");
          gen->set_offset(it->second.offset);
        }
        state.step = last_saved = st.step;
        resumed = true;
        if (lead) {
          std::printf("resumed from %s: step %lld (saved on %d rank(s))\n", last.path.c_str(),
                      static_cast<long long>(state.step), st.world_size);
          if (st.world_size != world)
            changed += (changed.empty() ? "" : ", ") + std::to_string(world) + " rank(s) (checkpoint: " +
                       std::to_string(st.world_size) + ")";
          if (!changed.empty())
            std::printf("note: resuming with other settings than the checkpoint's: %s; training continues, but "
                        "is not the bit-exact continuation\n", changed.c_str());
        }
      } else if (lead) {
        std::printf("no checkpoint in %s; starting from step 0\n", opt.checkpoint_dir.c_str());
      }
    }
    std::unique_ptr<ckpt::PreemptionHandler> preempt;
    if (checkpoints) preempt = std::make_unique<ckpt::PreemptionHandler>();
    auto trainer_state = [&] {  // collective under pipeline
      ckpt::TrainerState ts;
      ts.sampler = ckpt::SamplerState{0, train_windows.position() * replicas * opt.batch, replicas};
      const auto streams = model.generators();
      std::vector<std::int64_t> offsets;
      for (const auto& [name, gen] : streams) offsets.push_back(static_cast<std::int64_t>(gen->offset()));
      if (mesh) mesh->pipeline_group().all_reduce(offsets.data(), offsets.size(), DType::I64, dist::ReduceOp::Max);
      for (std::size_t i = 0; i < streams.size(); ++i)
        ts.rng["dropout/" + streams[i].first] = {streams[i].second->seed(), static_cast<std::uint64_t>(offsets[i])};
      ts.schedule = schedule;
      ts.user = {{"program", "gpt_char"}, {"model", model_cfg}, {"train", train_cfg}};
      return ts;
    };
    // Collective. In the background: returns after a copy to host memory.
    auto save = [&](bool background) {
      if (pipe) {
        const ckpt::StageSnapshot mine = ckpt::stage_snapshot(comm.get(), *pipe, &optimizer, trainer_state());
        if (background) saver->save_sharded(state.step, mine.tensors, mine.state);
        else checkpoints->save_sharded(state.step, mine.tensors, mine.state);
      } else if (fsdp) {
        const ckpt::ShardedState mine = ckpt::fsdp_state(*fsdp, &optimizer);
        if (background) saver->save_sharded(state.step, mine, trainer_state());
        else checkpoints->save_sharded(state.step, mine, trainer_state());
      } else if (background) {
        saver->save(state.step, *params, &optimizer, trainer_state());
      } else {
        checkpoints->save(state.step, *params, &optimizer, trainer_state());
      }
      last_saved = state.step;
    };

    MetricsWriter metrics(lead ? opt.metrics : "", resumed);
    const char* unit = corpus.chars ? "char" : "token";
    Progress progress(opt.steps, lead ? opt.log_every : 0, std::cout, state.step);
    const double tokens_per_step = static_cast<double>(opt.batch * opt.grad_accum * opt.block * replicas);
    if (lead) {
      std::printf("%s, vocabulary %lld, unigram entropy %.4f nats/%s\n", corpus.describe.c_str(),
                  static_cast<long long>(corpus.vocab_size), entropy, unit);
      std::printf("model %s: %lld parameters, %.1f MFLOP/token; %lld steps of %.0f tokens on %d rank(s)\n",
                  model.describe().c_str(), static_cast<long long>(num_parameters),
                  cfg.flops_per_token(opt.block) / 1e6, static_cast<long long>(opt.steps), tokens_per_step, world);
      std::printf("device %s, precision %s\n", device.str().c_str(), opt.precision.c_str());
      if (fsdp)
        std::printf("parallel: %s over %d rank(s) (shard groups of %d)\n", fsdp->describe().c_str(), world,
                    fsdp->shard_size());
      if (pipe)
        std::printf("parallel: pipeline of %d stages (units %s) x %d replica(s), %d micro-batches, %s\n",
                    pipe->num_stages(), pipe->partition().str().c_str(), replicas, opt.micro_batches,
                    opt.schedule.c_str());
      metrics.write({{"event", "config"}, {"vocab_size", corpus.vocab_size}, {"train_tokens", corpus.train.size()},
                     {"parameters", num_parameters}, {"unigram_entropy", entropy}, {"world_size", world},
                     {"start_step", state.step}});
    }

    Tensor<std::int32_t> x, y;
    nn::Cache<T> cache, loss_cache;
    double val_loss = 0;
    auto validate = [&] {
      // Every rank evaluates (FSDP's forward and the pipeline's are collective); the result is
      // identical on every rank (the pipeline averages over its replicas itself).
      const double mean = evaluate(model, val_windows, opt.eval_batches, opt.batch, [&](auto& vx, auto& vy) {
        if (pipe) return pipe->eval_step_tokens(vx.to(device), vy.to(device));
        nn::Cache<T> c, lc;
        return ce.forward((fsdp ? net : model).forward_tokens(vx.to(device), c), vy.to(device), lc);
      });
      val_loss = pipe ? mean : average(mean);
      if (lead) {
        std::printf("step %lld: val_loss %.4f (%.3f x unigram entropy)\n", static_cast<long long>(state.step),
                    val_loss, val_loss / entropy);
        metrics.write({{"step", state.step}, {"val_loss", val_loss}, {"unigram_entropy", entropy},
                       {"val_loss_over_entropy", val_loss / entropy}});
      }
    };
    // One batch's forward and backward; the loss gradient is scaled by 1 / --grad-accum,
    // so that the accumulated gradient is that of the mean loss over the step's batches.
    auto accumulate = [&] {
      train_windows.next(opt.batch, x, y);
      const double l = ce.forward(net.forward_tokens(x.to(device), cache), y.to(device), loss_cache);
      net.backward(ce.backward(loss_cache, static_cast<acc_t<T>>(1.0 / opt.grad_accum)), cache);
      return l;
    };
    while (state.step < opt.steps) {
      optimizer.set_lr(schedule(state.step));
      double loss = 0;
      if (pipe) {  // zeroes, accumulates the micro-batches and averages over the replicas
        train_windows.next(opt.batch, x, y);
        loss = pipe->train_step_tokens(x.to(device), y.to(device));
      } else {
        zero_grad();
        // All but the last batch add up locally (DDP/FSDP no_sync); the last backward reduces the sum.
        for (int k = 1; k < opt.grad_accum; ++k) {
          if (ddp) {
            auto local = ddp->no_sync();
            loss += accumulate();
          } else if (fsdp) {
            auto local = fsdp->no_sync();
            loss += accumulate();
          } else {
            loss += accumulate();
          }
        }
        loss += accumulate();
        if (ddp) ddp->finish_gradient_sync();
        if (fsdp) fsdp->finish_gradient_sync();
        loss = average(loss / opt.grad_accum);
      }
      const double norm = clip();
      if (fsdp) fsdp->optimizer_step(optimizer);  // steps the local shard; ZeRO-1/2 re-gather their full copy
      else optimizer.step();
      ++state.step;
      progress.update(state.step, 1, loss, optimizer.lr(), static_cast<std::int64_t>(tokens_per_step));
      if (lead)
        metrics.write({{"step", state.step}, {"loss", loss}, {"lr", optimizer.lr()}, {"grad_norm", norm},
                       {"data_position", train_windows.position()}});
      if (opt.eval_every > 0 && state.step % opt.eval_every == 0 && state.step < opt.steps) validate();
      if (saver && opt.checkpoint_every > 0 && state.step % opt.checkpoint_every == 0) save(true);
      // One all-reduce per step: every rank stops at the same step when any got a signal.
      if (preempt && preempt->should_stop(comm.get())) {
        saver->wait();  // rank 0: the save in flight (perhaps of this very step) is committed
        if (last_saved != state.step) save(false);
        else if (comm) comm->barrier();  // a launcher stops every rank once one exits: not before rank 0 commits
        if (lead) {
          std::printf("signal %d: checkpoint of step %lld committed in %s; exiting\n", preempt->signal(),
                      static_cast<long long>(state.step), opt.checkpoint_dir.c_str());
          std::fflush(stdout);  // the launcher's SIGTERM may come before exit() flushes a pipe
        }
        return opt.preempt_exit_code;
      }
    }
    // The final checkpoint comes before evaluation and sampling, which change no training state.
    if (saver) {
      saver->wait();
      if (last_saved != state.step) save(false);
    }
    validate();

    // Sampling and --export need the whole parameters on rank 0. Under pipeline,
    // rank 0 (stage 0 of replica 0) holds only its stage's current values: the
    // other stages of replica 0 send theirs, parameter by parameter in the
    // model's order, into its copy of the model, on the training device. Under FSDP the
    // model object is intact but FullShard/Hybrid released its tensors: every rank
    // gathers them (full_parameters is collective) and rank 0 binds the model's own
    // Parameters to the copies, so generate() and the tied head work unchanged and
    // no second model is built. FSDP is not used after this.
    const bool gather = opt.sample_tokens > 0 || !opt.export_path.empty() || !opt.export_hf.empty();
    if (fsdp && gather) {
      auto full = fsdp->full_parameters();
      if (lead) {
        std::map<std::string, Tensor<T>> by_name(full.begin(), full.end());
        for (auto& p : model.named_parameters()) {
          const auto it = by_name.find(p.name);
          PTRAIN_CHECK(it != by_name.end(), Error, "[ptrain.example.fsdp] FSDP has no parameter '", p.name, "'");
          p.param->value = it->second;
        }
      }
    }
    if (pipe && mesh->replica() == 0 && gather) {
      dist::Communicator& stages = mesh->pipeline_group();
      const auto& part = pipe->partition();
      for (int s = 1; s < stages.size(); ++s) {
        if (!lead && stages.rank() != s) continue;
        for (std::size_t u = part.begin(s); u < part.end(s); ++u) {
          if (lead && !device.is_cpu()) model.units()[u]->to(device);
          for (auto& p : model.units()[u]->named_parameters()) {
            if (lead) stages.recv(p.param->value, s);
            else stages.send(p.param->value, 0);
          }
        }
      }
    }
    if (lead && !opt.export_path.empty()) {
      std::vector<ckpt::TensorRef> refs;
      std::vector<Tensor<T>> host;  // the file is written from host memory
      for (auto& p : model.named_parameters()) host.push_back(p.param->value.to(Device::cpu()));
      std::size_t i = 0;
      for (auto& p : model.named_parameters()) refs.push_back(ckpt::tensor_ref(p.name, host[i++]));
      ckpt::write_safetensors(opt.export_path, refs, {{"format", "pt"}, {"ptrain.step", std::to_string(state.step)}});
      std::printf("exported %zu tensors of step %lld to %s\n", refs.size(), static_cast<long long>(state.step),
                  opt.export_path.c_str());
    }
    if (lead && !opt.export_hf.empty()) {
      // The tokenizer's vocabulary (not the padded one) and its files: a folder transformers loads whole.
      const std::string what = ckpt::save_gpt2_weights(opt.export_hf, model, corpus.bpe ? corpus.bpe->vocab_size() : 0);
      for (const char* f : {"vocab.json", "merges.txt"})
        if (corpus.bpe && std::filesystem::is_regular_file(std::filesystem::path(opt.tokenizer) / f))
          std::filesystem::copy_file(std::filesystem::path(opt.tokenizer) / f, std::filesystem::path(opt.export_hf) / f,
                                     std::filesystem::copy_options::overwrite_existing);
      std::printf("exported step %lld as Hugging Face GPT-2 to %s: %s\n", static_cast<long long>(state.step),
                  opt.export_hf.c_str(), what.c_str());
    }

    if (lead) {
      if (opt.sample_tokens > 0) {
        // Token files without --tokenizer: the sample continues the first validation token
        // and is printed as ids. A padded vocabulary's extra ids are never sampled.
        const bool text = corpus.can_encode();
        const std::vector<std::int32_t> prompt =
            text ? corpus.encode(opt.prompt) : std::vector<std::int32_t>{static_cast<std::int32_t>(corpus.val.at(0, 0))};
        Generator sample_gen(opt.seed);
        const auto out = nn::generate(model, prompt, opt.sample_tokens, opt.temperature, opt.top_k, sample_gen,
                                      corpus.bpe ? corpus.bpe->vocab_size() : 0);
        std::string sample;
        if (text) sample = corpus.decode(out);
        else
          for (std::int32_t t : out) sample += (sample.empty() ? "" : " ") + std::to_string(t);
        std::printf("--- sample%s ---\n%s\n--------------\n", text ? "" : " (token ids)", sample.c_str());
      }
      const double secs = wall.seconds();
      std::printf("final val_loss %.4f nats/%s = %.3f x unigram entropy %.4f; wall time %.1f s\n", val_loss, unit,
                  val_loss / entropy, entropy, secs);
      metrics.write({{"event", "final"}, {"step", state.step}, {"val_loss", val_loss}, {"unigram_entropy", entropy},
                     {"wall_s", secs}});
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "gpt_char: %s\n", e.what());
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"Train a GPT with ptrain on the characters of a text or on token files"};
  auto* data = app.add_option("--data", opt.data, "plain-text file (default: the fortunes corpus in "
                              "/usr/share/games/fortunes)");
  auto* train_tokens = app.add_option("--train-tokens", opt.train_tokens, "token files to train on instead of text: "
                                      "nanoGPT's train.bin or llm.c's shards (paths or quoted glob patterns)");
  auto* val_tokens = app.add_option("--val-tokens", opt.val_tokens, "token files to validate on (with --train-tokens)");
  auto* vocab = app.add_option("--vocab-size", opt.vocab_size, "vocabulary of the token files, or padded above "
                               "--tokenizer's (e.g. 50304 for GPT-2's 50257 ids)")->check(positive);
  auto* tokenizer = app.add_option("--tokenizer", opt.tokenizer, "folder of a GPT-2 tokenizer (vocab.json + "
                                   "merges.txt): --data as BPE tokens, --prompt and the sample of token files as text");
  app.add_option("--token-format", opt.token_format, "u16 or i32: ids of raw token files (llm.c shards say theirs)")
      ->check(CLI::IsMember({"u16", "i32"}));
  train_tokens->needs(val_tokens)->excludes(data);
  val_tokens->needs(train_tokens);
  app.add_option("--parallel", opt.parallel, "none, ddp, fsdp or pipeline (under mpirun or ptrun)")
      ->check(CLI::IsMember({"none", "ddp", "fsdp", "pipeline"}));
  app.add_option("--device", opt.device, "cpu, or cuda: the GPU of LOCAL_RANK, NCCL between ranks (gpt_char_cuda)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--precision", opt.precision, "fp32, or bf16: bf16 parameters and activations with fp32 master "
                 "weights")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--fsdp-strategy", opt.fsdp_strategy, "with --parallel fsdp: full_shard (ZeRO-3), shard_grad_op "
                 "(ZeRO-2), shard_optimizer (ZeRO-1), no_shard, or hybrid")
      ->check(CLI::IsMember({"full_shard", "shard_grad_op", "shard_optimizer", "no_shard", "hybrid"}));
  app.add_option("--hybrid-shard-size", opt.hybrid_shard_size, "ranks per shard group of --fsdp-strategy hybrid "
                 "(0: the launcher's ranks per node)")->check(non_negative);
  app.add_option("--stages", opt.stages, "with --parallel pipeline: stages per replica; the ranks form "
                 "world / stages replicas (0: one stage per rank)")->check(non_negative);
  app.add_option("--micro-batches", opt.micro_batches, "with --parallel pipeline: micro-batches per --batch")
      ->check(positive);
  app.add_option("--schedule", opt.schedule, "with --parallel pipeline: 1f1b or gpipe")
      ->check(CLI::IsMember({"1f1b", "gpipe"}));
  app.add_flag("--untied", opt.untied, "give the LM head its own weight instead of the token embedding's "
               "(always so under --parallel pipeline)");
  app.add_flag("--recompute", opt.recompute, "recompute each block's activations in backward (activation "
               "checkpointing: same results, less memory, about a third more compute)");
  app.add_option("--steps", opt.steps, "optimizer steps")->check(non_negative);
  app.add_option("--batch", opt.batch, "sequences per step and replica (a rank, or the stages of one pipeline)")
      ->check(positive);
  app.add_option("--grad-accum", opt.grad_accum, "batches per optimizer step, their gradients added up (the "
                 "global batch is --batch x --grad-accum x replicas; not with --parallel pipeline)")->check(positive);
  app.add_option("--block", opt.block, "context length")->check(positive);
  app.add_option("--layers", opt.n_layer, "transformer blocks");
  app.add_option("--heads", opt.n_head, "attention heads")->check(positive);
  app.add_option("--embd", opt.n_embd, "embedding width")->check(positive);
  app.add_option("--dropout", opt.dropout, "dropout probability");
  app.add_option("--lr", opt.lr, "peak AdamW learning rate");
  app.add_option("--min-lr", opt.min_lr, "learning rate at the end of the cosine decay");
  app.add_option("--weight-decay", opt.weight_decay, "AdamW weight decay (matrices only)");
  app.add_option("--grad-clip", opt.grad_clip, "clip the global gradient norm (0: off)");
  app.add_option("--warmup", opt.warmup, "linear warmup steps");
  app.add_option("--eval-every", opt.eval_every, "validate every N steps (and at the end)");
  app.add_option("--eval-batches", opt.eval_batches, "validation batches")->check(positive);
  app.add_option("--seed", opt.seed, "seed for initialisation, windows and sampling");
  app.add_option("--metrics", opt.metrics, "write JSON-lines metrics to this file (rank 0)");
  app.add_option("--log-every", opt.log_every, "progress line every N steps (0: none)");
  app.add_option("--sample-tokens", opt.sample_tokens, "tokens (characters) to generate at the end");
  app.add_option("--temperature", opt.temperature, "sampling temperature (0: greedy)")->check(non_negative);
  app.add_option("--top-k", opt.top_k, "sample among the k most likely tokens (0: all)");
  auto* prompt = app.add_option("--prompt", opt.prompt, "text the sample continues (token files: with --tokenizer)");
  app.add_option("--save-tokenizer", opt.save_tokenizer, "write the character vocabulary (JSON) to this file")
      ->excludes(train_tokens)->excludes(tokenizer);
  app.add_option("--threads", opt.threads, "GEMM threads per process (0: library default; 1 under ddp/fsdp)");
  add_checkpoint_flags(app, opt);
  app.add_option("--init-from", opt.init_from, "start from pretrained weights: a Hugging Face GPT-2 "
                 "model.safetensors (or its folder) or a ptrain file (--export, a checkpoint's model.safetensors)");
  app.add_option("--export", opt.export_path, "at the end, rank 0 writes the final parameters, whole, to this "
                 "safetensors file (PyTorch's safetensors.torch.load_file reads it)");
  app.add_option("--export-hf", opt.export_hf, "at the end, rank 0 writes the model as a Hugging Face GPT-2 folder "
                 "(model.safetensors, config.json, --tokenizer's files) for transformers' from_pretrained");
  CLI11_PARSE(app, argc, argv);
  if (opt.resume && opt.checkpoint_dir.empty()) {
    std::fprintf(stderr, "gpt_char: --resume needs --checkpoint-dir\n");
    return 2;
  }
  if (train_tokens->count() > 0 && tokenizer->count() == 0) {
    const char* missing = vocab->count() == 0 ? "--train-tokens requires --vocab-size (or --tokenizer)"
                          : prompt->count() > 0 ? "--prompt with --train-tokens requires --tokenizer"
                                                : nullptr;
    if (missing) {
      std::fprintf(stderr, "gpt_char: %s\n", missing);
      return 2;
    }
  }

  return opt.precision == "bf16" ? run<bf16>(opt) : run<float>(opt);
}
