// Trains a character-level GPT on plain text and prints validation loss and a sample.
//
//   build/examples/gpt_char                                   # the fortunes corpus, single process
//   build/examples/gpt_char --data input.txt --steps 5000     # any plain-text file
//   mpirun -np 2 build/examples/gpt_char --parallel ddp       # data parallel (also under ptrun)
//   ptrun --nproc-per-node 2 gpt_char --parallel fsdp          # fully sharded (--fsdp-strategy ...)
//   ptrun --nproc-per-node 4 gpt_char --parallel pipeline --stages 2 --micro-batches 4   # 2 replicas x 2 stages
//   ptrun --nproc-per-node 2 gpt_char --parallel pipeline --virtual-stages 2   # interleaved 1F1B, 2 chunks a stage
//   mpirun -np 4 build/examples/gpt_char --parallel tp --tp 2   # tensor parallel: 2 replicas x tp 2
//   mpirun -np 4 build/examples/gpt_char --parallel fsdp --tp 2 # FSDP x TP: each tp shard sharded over the 2 replicas
//   mpirun -np 2 build/examples/gpt_char --context-parallel 2  # each sequence split over 2 ranks (ring attention)
//   mpirun -np 4 build/examples/gpt_char --context-parallel 2 --parallel fsdp  # and the weights sharded over all 4
//   mpirun -np 4 build/examples/gpt_char --context-parallel 2 --tp 2  # cp 2 inside tp 2 (each tp rank's heads: a ring)
//   ptrun --nproc-per-node 2 gpt_char --parallel ddp --batch 8 --grad-accum 4   # 64 sequences per step
//   mpirun -np 4 build/examples/gpt_char --model mixtral --parallel ddp --experts 8 --moe-top-k 2   # MoE blocks
//   mpirun -np 4 build/examples/gpt_char --model mixtral --parallel ddp --expert-parallel 2   # ep 2 x dp 2
//   mpirun -np 4 build/examples/gpt_char --model mixtral --parallel tp --tp 2 --expert-parallel 2   # tp 2 x dp 2, ep 2
//   mpirun -np 4 build/examples/gpt_char --model mixtral --parallel fsdp --expert-parallel 2  # and FSDP-sharded
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
// the GPU of the rank's LOCAL_RANK, with NCCL between ranks: it needs this file
// linked with ptrain::cuda, gpt_char_cuda (built where CMake finds the toolkit):
//   gpt_char_cuda --device cuda --precision bf16 --batch 64 --block 256 --layers 6 --embd 384
//   torchrun --nproc-per-node 8 --no-python gpt_char_cuda --device cuda --precision bf16 --parallel fsdp
//
// Data: Debian's `fortunes` package (/usr/share/games/fortunes, about 2.5 MB of
// English): every fortune file, in name order, without the "%" separator lines.
// The last 10% of the characters are the validation split. Or pre-tokenized
// files, nanoGPT's train.bin/val.bin or llm.c's shards, mapped rather than read:
//   gpt_char --train-tokens 'data/fineweb_train_*.bin' --val-tokens 'data/fineweb_val_*.bin' --vocab-size 50304
// --tokenizer PATH (GPT-2's vocab.json + merges.txt, a tokenizer.json, tiktoken ranks or
// a SentencePiece model: Tokenizer::load) tokenizes --data instead of characters, and
// encodes --prompt and decodes the sample of token files;
// with --init-from, nanoGPT's fine-tuning of GPT-2 on a text:
//   gpt_char --data input.txt --tokenizer gpt2 --init-from gpt2/model.safetensors --block 256 --layers 12 --heads 12 --embd 768
// Metrics (--metrics) are JSON lines; evaluation lines carry val_loss and
// unigram_entropy (nats per token: the loss of the best context-free model).
//
// The training step is the same in every mode: it talks to a parallel::Engine
// (zero_grad, forward_backward under no_sync for --grad-accum, clip_grad_norm_,
// step), evaluates with eval_loss and checkpoints with ckpt::save / ckpt::load;
// the modes differ only in build_engine (Note [gpt_char engines]).
// The state a checkpoint needs besides the engine's parameters and the optimizer
// is in TrainState: step, the train windows' position and the dropout streams'
// offsets (model.generators()); the LR schedule is a function of the step.
// Note [gpt_char resume state] says how each is saved and restored.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <functional>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/ckpt/full_state_dict.hpp>
#include <ptrain/nn/models/gpt2_weights.hpp>
#include <ptrain/ckpt/preemption.hpp>
#include <ptrain/data/tokenizer.hpp>
#include <ptrain/data/text.hpp>
#include <ptrain/dist/launch_env.hpp>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/nn/models/llama_weights.hpp>
#include <ptrain/parallel/make_engine.hpp>
#include <ptrain/ptrain.hpp>

#include "checkpoint_flags.hpp"
#include "cli_checks.hpp"
#include "observe_flags.hpp"

using namespace ptrain;

namespace {

constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

struct Options {
  std::string model = "gpt";  // gpt, llama or mixtral (a Llama with MoE blocks)
  std::string data;  // empty: the fortunes corpus
  std::vector<std::string> train_tokens, val_tokens;  // token files instead of text (paths or glob patterns)
  std::string token_format = "u16";
  std::int64_t vocab_size = 0;  // of the token files (0: the tokenizer's)
  std::string tokenizer;         // GPT-2 BPE folder; empty: characters (text) or none (token files)
  std::string parallel = "none";
  std::string device = "cpu";
  std::string precision = "fp32";
  std::string cuda_graphs = "on";  // --cuda-graphs: capture the step in a CUDA graph (--device cuda)
  std::string fsdp_strategy = "full_shard";
  int hybrid_shard_size = 0;  // 0: the launcher's ranks per node
  int stages = 0;             // --parallel pipeline: stages per replica (0: every rank one stage)
  int tp = 2;                 // --parallel tp: ranks per tensor-parallel group
  bool sequence_parallel = false;  // --parallel tp: the residual stream cut along the sequence
  bool fsdp_tp = false;       // --parallel fsdp with --tp: each tp shard sharded over the replicas (FSDP x TP)
  int context_parallel = 0;   // --context-parallel: ranks per sequence (--parallel cp; 0: none)
  bool cp_fsdp = false;       // --context-parallel with --parallel fsdp: FSDP over the dp x cp ranks
  bool cp_tp = false;         // --context-parallel with --tp: context parallelism inside tensor parallelism
  int micro_batches = 4;
  std::string schedule = "1f1b";
  int virtual_stages = 1;     // --parallel pipeline: chunks per stage (> 1: the interleaved schedule)
  bool untied = false;        // the LM head has its own weight (always under --parallel pipeline)
  bool recompute = false;     // activation checkpointing of every block
  std::int64_t steps = 1500;
  std::int64_t batch = 16;  // per replica: a rank, or the stages of one pipeline
  int grad_accum = 1;       // batches whose gradients add up to one optimizer step (not under pipeline)
  std::int64_t block = 128;
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  std::int64_t n_kv_head = 0;        // --model llama: key/value heads (0: --heads)
  std::int64_t intermediate = 0;     // --model llama: SwiGLU width (0: 8/3 --embd, rounded up to 32)
  double rope_theta = 10000.0;       // --model llama
  std::int32_t document_token = -1;  // --model llama: a token that starts each packed document
  std::int64_t experts = 8;          // --model mixtral: experts per MoE layer
  std::int64_t moe_top_k = 2;        // --model mixtral: experts per token
  std::int64_t moe_every = 1;        // --model mixtral: every n-th block is an MoE block
  double capacity_factor = 0;        // --model mixtral: 0 dropless
  double aux_loss_coef = 0.01;       // --model mixtral: load-balancing loss coefficient
  double z_loss_coef = 0;            // --model mixtral: router z-loss coefficient
  int expert_parallel = 1;           // --model mixtral --parallel ddp or tp: ranks that split each layer's experts
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
  ObserveFlags observe;
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
  bool start_over = false;
  std::string export_path;
  std::string export_hf;  // Hugging Face folder (GPT-2, or the Llama family for --model llama)
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
// characters or as tokens of --tokenizer (GPT-2, Llama 3 or SentencePiece), the last 10% for validation; or
// token files (--train-tokens, --val-tokens), mapped and read where the windows fall.
struct Corpus {
  std::optional<CharTokenizer> chars;  // a text without --tokenizer
  std::optional<Tokenizer> tok;        // --tokenizer
  TokenCorpus train, val;
  std::int64_t vocab_size;
  double entropy;  // unigram entropy (nats per token): of the whole text, or of the validation files
  std::string describe;

  bool can_encode() const { return chars || tok; }  // token files without --tokenizer cannot
  std::vector<std::int32_t> encode(std::string_view text) const {
    return chars ? chars->encode(text) : tok->encode(text);
  }
  std::string decode(const std::vector<std::int32_t>& ids) const { return chars ? chars->decode(ids) : tok->decode(ids); }
};

Corpus load_corpus(const Options& o) {
  std::optional<Tokenizer> tok;
  std::int64_t vocab = o.vocab_size;
  if (!o.tokenizer.empty()) {
    tok = Tokenizer::load(o.tokenizer);
    const std::int64_t padded = (tok->vocab_size() + 63) / 64 * 64;
    PTRAIN_CHECK(vocab == 0 || vocab >= tok->vocab_size(), DataError, "[gpt_char.vocab] --vocab-size ", vocab,
                 " is smaller than the tokenizer's ", tok->vocab_size(), " ids; pass at least that (e.g. ", padded,
                 ") or leave it out");
    if (vocab == 0) vocab = tok->vocab_size();
  }
  if (!o.train_tokens.empty()) {
    const TokenFormat f = o.token_format == "i32" ? TokenFormat::I32 : TokenFormat::U16;
    TokenCorpus train = TokenCorpus::open(glob_paths(o.train_tokens), f);
    TokenCorpus val = TokenCorpus::open(glob_paths(o.val_tokens), f);
    const double entropy = unigram_entropy(val, vocab);  // also checks every validation id
    const std::string what = "token files: train " + train.describe() + ", validation " + val.describe();
    return {std::nullopt, std::move(tok), std::move(train), std::move(val), vocab, entropy, what};
  }
  const std::string text = o.data.empty() ? fortunes_corpus() : read_text_file(o.data);
  std::string what = "corpus " + (o.data.empty() ? std::string(kFortunesDir) : o.data) + ": ";
  std::optional<CharTokenizer> chars;
  Tensor<std::int32_t> ids;
  if (tok) {
    const std::vector<std::int32_t> v = tok->encode(text);
    ids = Tensor<std::int32_t>::from(v, {static_cast<std::int64_t>(v.size())});
    what += std::to_string(text.size()) + " bytes, " + std::to_string(ids.numel()) + " " + tok->kind_name() + " tokens";
  } else {
    chars = CharTokenizer::fit(text);
    ids = chars->encode_tensor(text);
    vocab = chars->vocab_size();
    what += std::to_string(ids.numel()) + " characters";
  }
  const std::int64_t n = ids.numel(), n_val = n / 10;
  const double entropy = unigram_entropy(ids, vocab);
  return {std::move(chars), std::move(tok), ids.narrow(0, n - n_val), ids.narrow(n - n_val, n_val), vocab, entropy,
          what};
}


// Whether the model is cut into pipeline stages (then it is untied: one weight
// cannot live on two stages).
bool pipelined(const Options& o) { return o.parallel == "pipeline" || (o.parallel == "tp" && o.stages > 1); }

// The pipeline's schedule: "1f1b", "gpipe" or "interleaved v 2".
std::string schedule_label(const Options& o) {
  return o.virtual_stages > 1 ? "interleaved v " + std::to_string(o.virtual_stages) : o.schedule;
}

// --parallel with its options: "none", "ddp", "fsdp full_shard", "fsdp hybrid 2",
// "pipeline 2 stages x 2 replicas, m 4, 1f1b", "tp 2 x pp 2 x dp 1, m 4, 1f1b".
std::string parallel_layout(const Options& o, int world) {
  if (o.parallel == "pipeline") {
    const int pp = o.stages > 0 ? o.stages : world;
    return "pipeline " + std::to_string(pp) + " stages x " + std::to_string(world / pp) + " replicas, m " +
           std::to_string(o.micro_batches) + ", " + schedule_label(o);
  }
  if (o.parallel == "tp" && o.stages > 1)
    return detail::cat("tp ", o.tp, " x pp ", o.stages, " x dp ", world / (o.tp * o.stages), ", m ", o.micro_batches,
                       ", ", schedule_label(o));
  if (o.parallel == "tp")
    return "tp " + std::to_string(o.tp) + " x dp " + std::to_string(world / o.tp) +
           (o.expert_parallel > 1 ? ", ep " + std::to_string(o.expert_parallel) : "");
  if (o.parallel == "cp") {
    const int tp = o.cp_tp ? o.tp : 1;
    return "cp " + std::to_string(o.context_parallel) + (o.cp_tp ? " x tp " + std::to_string(tp) : "") + " x dp " +
           std::to_string(world / (o.context_parallel * tp)) + (o.cp_fsdp ? " with fsdp" : "");
  }
  const std::string ep = o.expert_parallel > 1 ? detail::cat(", ep ", o.expert_parallel, " x dp ",
                                                              world / o.expert_parallel) : "";
  if (o.parallel != "fsdp") return o.parallel + ep;
  if (o.fsdp_tp) return detail::cat("fsdp ", o.fsdp_strategy, " x tp ", o.tp, " (dp ", world / o.tp, ")");
  return "fsdp " + o.fsdp_strategy + (o.fsdp_strategy == "hybrid" ? " " + std::to_string(o.hybrid_shard_size) : "") +
         ep;
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
                               : key == "model"   ? nlohmann::json("gpt")
                                                  : nlohmann::json();
    const nlohmann::json have = user.at("model").value(key, old);
    if (have == want) continue;
    model_diff += (key == "vocab" ? "; vocabulary size " : "; --" + key + " ") + have.dump() + " in the checkpoint, " +
                  want.dump() + (key == "vocab" ? " from the data now" : " now") +
                  (key == "untied" ? " (a pipeline always trains an untied model)" : "");
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

// Flags that contradict each other or the world, refused before anything is read.
void check_parallel_flags(const Options& o, int world) {
  if (o.expert_parallel > 1) {
    PTRAIN_CHECK(o.model == "mixtral" && (o.parallel == "ddp" || (o.parallel == "tp" && o.stages <= 1) ||
                                          (o.parallel == "fsdp" && !o.fsdp_tp) || o.parallel == "pipeline"), Error,
                 "[gpt_char.ep] --expert-parallel ", o.expert_parallel, " splits the experts of --model mixtral "
                 "under --parallel ddp, fsdp (without --tp), tp (without --stages) or pipeline (got --model ", o.model,
                 " --parallel ", o.parallel, o.fsdp_tp ? " --tp" : "", "); add --model mixtral --parallel ddp (or "
                 "fsdp, tp, pipeline) or leave it out");
    PTRAIN_CHECK(world % o.expert_parallel == 0 && o.experts % o.expert_parallel == 0, Error, "[gpt_char.ep] "
                 "--expert-parallel ", o.expert_parallel, " must divide the world (", world, " ranks) and --experts (",
                 o.experts, "): launch a multiple of it and choose a divisor of --experts");
  }
  if (o.parallel == "cp") {
    const int cp = o.context_parallel, ranks = cp * (o.cp_tp ? o.tp : 1);  // per replica
    PTRAIN_CHECK(world % ranks == 0 && o.block % (2 * cp) == 0, Error, "[gpt_char.cp] --context-parallel ", cp,
                 o.cp_tp ? detail::cat(" x --tp ", o.tp) : "", " needs a world that it divides (", world,
                 " ranks) and a --block that divides into 2 * ", cp, " chunks (", o.block, "): launch a multiple of ",
                 ranks, " ranks and use a --block that is a multiple of ", 2 * cp);
    PTRAIN_CHECK(o.dropout == 0 && o.device == "cpu" && o.precision == "fp32", Error, "[gpt_char.cp] "
                 "--context-parallel trains on the CPU in fp32 without dropout (docs/context_parallel.md); leave out "
                 "--dropout, --device and --precision");
  }
  PTRAIN_CHECK(!o.sequence_parallel || ((o.parallel == "tp" || o.fsdp_tp) && o.block % o.tp == 0), Error,
               "[gpt_char.sp] --sequence-parallel cuts each sequence of --block ", o.block, " tokens into --tp ", o.tp,
               " slices: use it with --parallel tp (or fsdp with --tp) and a --block that is a multiple of --tp");
  if (!pipelined(o)) return;
  const int pp = o.parallel == "tp" ? o.stages : o.stages > 0 ? o.stages : world;
  PTRAIN_CHECK(world % pp == 0, Error, "[gpt_char.stages] --stages ", pp, " does not divide the ", world,
               " ranks; launch a multiple of --stages ranks (each group of --stages ranks is one replica)");
  PTRAIN_CHECK(o.grad_accum == 1, Error, "[gpt_char.grad_accum] --parallel pipeline accumulates its "
               "--micro-batches already; instead of --grad-accum ", o.grad_accum, " multiply --batch and "
               "--micro-batches by ", o.grad_accum);
  PTRAIN_CHECK(o.batch % o.micro_batches == 0, Error, "[gpt_char.micro_batches] --batch ", o.batch,
               " is not divisible by --micro-batches ", o.micro_batches, "; pick a multiple");
  const int v = o.virtual_stages;
  PTRAIN_CHECK(o.n_layer + 2 >= pp * v, Error, "[gpt_char.stages] ", pp, " stages", v > 1 ? " x " : "",
               v > 1 ? std::to_string(v) + " virtual stages" : std::string(), " for ", o.n_layer + 2,
               " units (embedding, ", o.n_layer, " blocks, head); every ", v > 1 ? "chunk" : "stage",
               " needs a unit: use fewer, or more --layers");
  if (v == 1) return;
  PTRAIN_CHECK(o.schedule == "1f1b", Error, "[gpt_char.virtual_stages] --virtual-stages ", v, " runs the "
               "interleaved 1F1B schedule; drop --schedule ", o.schedule, " (or use --virtual-stages 1)");
  PTRAIN_CHECK(o.micro_batches % pp == 0, Error, "[gpt_char.micro_batches] --virtual-stages ", v, " runs "
               "micro-batches in groups of --stages ", pp, "; --micro-batches ", o.micro_batches,
               " is not a multiple of it: use ", (o.micro_batches + pp - 1) / pp * pp, " or another multiple");
}

// What the end of the run needs, checked before training: the prompt's tokens, the export's folders.
void check_end_of_run(const Options& o, const Corpus& corpus, bool lead) {
  if (corpus.can_encode() && o.sample_tokens > 0)
    PTRAIN_CHECK(!corpus.encode(o.prompt).empty(), Error, "[gpt_char.prompt] --prompt is empty; give the "
                 "sample some text to continue");
  for (const auto& [path, flag] : {std::pair{o.export_path, "--export"}, std::pair{o.export_hf, "--export-hf"}})
    if (const auto folder = std::filesystem::path(path).parent_path(); lead && !folder.empty())
      PTRAIN_CHECK(std::filesystem::is_directory(folder), Error, "[gpt_char.export] folder ", folder.string(),
                   " of ", flag, " does not exist; create it or choose another path");
}

// Note [gpt_char models]
// What differs between --model gpt and --model llama is in one struct per model
// (GptKind, LlamaKind): the config from the flags, the flags a checkpoint must
// match, the pipeline's unit costs, the decay filter, the dropout streams a
// checkpoint saves, pretrained weights in and Hugging Face folders out, and the
// sample. Everything else (engines, loop, checkpoints) is written once over them.

// The flags that fix the parameters' meaning, keyed by flag name ("vocab" comes
// from --data). --heads changes no tensor shape, so only this check catches it.
// Checkpoints from before --model existed are GPTs (check_checkpoint_config).
template <class T>
struct GptKind {
  using Model = nn::GPT<T>;
  using Config = nn::GPTConfig;
  static Config config(const Options& o, std::int64_t vocab, int rank) {
    return {.vocab_size = vocab, .block_size = o.block, .n_layer = o.n_layer, .n_head = o.n_head,
            .n_embd = o.n_embd, .dropout = o.dropout, .tie_weights = !o.untied && !pipelined(o),
            // The tp ranks of a replica share their (replicated) dropout masks.
            .dropout_seed = o.seed + static_cast<std::uint64_t>(o.parallel == "tp" || o.fsdp_tp ? rank / o.tp : rank),
            .recompute = o.recompute};
  }
  static nlohmann::json flags(const Config& c, const Options& o) {
    return {{"model", "gpt"}, {"vocab", c.vocab_size}, {"block", c.block_size}, {"layers", c.n_layer},
            {"heads", c.n_head}, {"embd", c.n_embd}, {"precision", o.precision}, {"untied", !c.tie_weights}};
  }
  // Forward matmul FLOPs per token of each unit (the embedding's lookup counts one per channel).
  static std::vector<double> unit_costs(const Config& c) {
    const auto C = static_cast<double>(c.n_embd), S = static_cast<double>(c.block_size);
    std::vector<double> cost{C};
    for (std::int64_t l = 0; l < c.n_layer; ++l) cost.push_back(24 * C * C + 4 * S * C);
    cost.push_back(2 * C * static_cast<double>(c.vocab_size));
    return cost;
  }
  static std::function<bool(const std::string&)> decay_filter() { return nn::gpt_decay_filter(); }
  static double aux_loss(Model&) { return 0; }
  static std::vector<std::pair<std::string, Generator*>> dropout_streams(Model& m) { return m.generators(); }
  static std::string load(const std::string& path, Model& m) { return ckpt::load_gpt2_weights(path, m); }
  static std::string save_hf(const std::string& folder, Model& m, std::int64_t vocab) {
    return "Hugging Face GPT-2: " + ckpt::save_gpt2_weights(folder, m, vocab);
  }
};

template <class T>
struct LlamaKind {
  using Model = nn::Llama<T>;
  using Config = nn::LlamaConfig;
  // A Hugging Face folder given to --init-from brings its own shape (config.json);
  // the shape flags describe a new model otherwise.
  static Config config(const Options& o, std::int64_t vocab, int rank) {
    (void)rank;  // no dropout streams
    Config c;
    const auto hf_config = std::filesystem::path(o.init_from) / "config.json";
    if (!o.init_from.empty() && std::filesystem::is_regular_file(hf_config)) {
      c = Config::from_hf_config_file(hf_config);
      PTRAIN_CHECK(vocab <= c.vocab_size, DataError, "[gpt_char.vocab] the data's vocabulary of ", vocab,
                   " ids does not fit the model's ", c.vocab_size, " in ", hf_config.string(),
                   "; tokenize with the model's own tokenizer");
      if (pipelined(o)) c.tie_weights = false;  // its head starts from embed_tokens
      c.document_token = o.document_token;
      c.recompute = o.recompute;
      if (c.num_experts > 0) set_moe_training(c, o);
      return c;
    }
    c.vocab_size = vocab;
    c.n_layer = o.n_layer;
    c.n_head = o.n_head;
    c.n_kv_head = o.n_kv_head > 0 ? o.n_kv_head : o.n_head;
    c.n_embd = o.n_embd;
    // Llama's rule for the SwiGLU width: two thirds of a 4C GELU MLP's, rounded up.
    c.intermediate_size = o.intermediate > 0 ? o.intermediate : (8 * o.n_embd / 3 + 31) / 32 * 32;
    c.max_seq_len = o.block;
    c.rope.theta = o.rope_theta;
    c.tie_weights = !o.untied && !pipelined(o);
    c.document_token = o.document_token;
    c.recompute = o.recompute;
    if (o.model == "mixtral") {
      c.num_experts = o.experts;
      c.top_k = o.moe_top_k;
      c.moe_every = o.moe_every;
      set_moe_training(c, o);
    }
    return c;
  }
  // The capacity factor and the auxiliary coefficients, which a Hugging Face folder
  // does not fix. Each forward adds its auxiliary losses' gradient (docs/moe.md): with
  // --grad-accum M, 1/M of the coefficients makes the step's gradient that of the mean.
  static void set_moe_training(Config& c, const Options& o) {
    c.moe_capacity_factor = o.capacity_factor;
    c.moe_aux_loss_coef = o.aux_loss_coef / o.grad_accum;
    c.moe_z_loss_coef = o.z_loss_coef / o.grad_accum;
  }
  static nlohmann::json flags(const Config& c, const Options& o) {
    nlohmann::json f = {{"model", "llama"}, {"vocab", c.vocab_size}, {"layers", c.n_layer}, {"heads", c.n_head},
                        {"kv-heads", c.n_kv_head}, {"embd", c.n_embd}, {"intermediate", c.intermediate_size},
                        {"rope-theta", c.rope.theta}, {"precision", o.precision}, {"untied", !c.tie_weights}};
    if (c.num_experts > 0)
      f.update({{"model", "mixtral"}, {"experts", c.num_experts}, {"moe-top-k", c.top_k}, {"moe-every", c.moe_every}});
    return f;
  }
  // The auxiliary losses of the latest forward (their gradients are in backward already).
  static double aux_loss(Model& m) { return m.moe_loss(); }
  static std::vector<double> unit_costs(const Config& c) {
    const auto C = static_cast<double>(c.n_embd), S = static_cast<double>(c.max_seq_len);
    const auto kv = static_cast<double>(c.n_kv_head * c.head_dim()), F = static_cast<double>(c.intermediate_size);
    std::vector<double> cost{C};
    for (std::int64_t l = 0; l < c.n_layer; ++l) cost.push_back(2 * (2 * C * C + 2 * C * kv + 3 * C * F) + 4 * S * C);
    cost.push_back(2 * C * static_cast<double>(c.vocab_size));
    return cost;
  }
  static std::function<bool(const std::string&)> decay_filter() { return nn::llama_decay_filter(); }
  static std::vector<std::pair<std::string, Generator*>> dropout_streams(Model&) { return {}; }
  static std::string load(const std::string& path, Model& m) { return ckpt::load_llama_weights(path, m); }
  static std::string save_hf(const std::string& folder, Model& m, std::int64_t vocab) {
    const std::string architecture = m.config().to_hf_config()["architectures"][0];
    return "Hugging Face " + architecture + ": " + ckpt::save_llama_weights(folder, m, vocab);
  }
};

// The engine of --parallel, and what differs per mode besides it.
template <class T>
struct GptEngine {
  std::unique_ptr<parallel::Mesh> mesh;  // pipeline: the dp x pp mesh (declared first: outlives the engine)
  std::unique_ptr<parallel::Engine<T>> engine;
  std::string describe;  // the "parallel: ..." line (fsdp, pipeline)
  // Whether rank 0's model lacks trained parameters that other ranks hold (every mode
  // but none, ddp and cp without FSDP, whose model is the engine's): then the sample and
  // --export first gather them (ckpt::gather_full_model, collective).
  bool gather = false;
};

// Note [gpt_char engines]
// Where the modes differ in code: building the engine, and bringing the whole
// model back to rank 0 at the end; the loop, evaluation and checkpoints talk to
// the Engine alone. Every rank builds the whole GPT in host memory
// (one initialisation stream, so every mode starts where one process does, and
// the model lists the dropout streams and samples at the end by its own names).
// - none, ddp: parallel::make_engine on the model, moved to --device first.
// - fsdp: make_engine shards every unit (embedding, blocks, head) under the
//   model's parameter names and moves the shards to --device (the GPU never
//   holds the whole model); the model object and its tied head stay intact.
// - pipeline: a world / stages x stages Mesh; each rank keeps the units of its
//   stage (its --virtual-stages chunks; moved to --device), stages (chunks)
//   balanced by forward FLOPs (unit_costs);
//   the model is untied (one weight cannot live on two stages).
// - cp (--context-parallel): make_engine shares the model's modules (every rank
//   holds the whole model, as DDP) and splits each sequence over the cp ranks.
// - tp, ddp/fsdp/pipeline with --expert-parallel: rank 0's model lacks the other ranks' parts.
// For the sample and --export, where rank 0's model is not the engine's whole model
// (GptEngine::gather), ckpt::gather_full_model copies the trained tensors into it:
// the pieces a checkpoint of the engine would hold, each sent once (FSDP: onto new
// tensors on --device; a pipeline: its other stages' units moved to --device first).
// A model too large for one host builds each rank's units alone instead
// (FSDP(num_units, nn::gpt_unit, ...), Pipeline(mesh, num_units, nn::gpt_unit, ...)).
template <class T, class M>
GptEngine<T> build_engine(Options& o, const std::shared_ptr<M>& model, const std::vector<double>& unit_costs,
                          dist::Communicator& world, Device device) {
  GptEngine<T> e;
  M& m = *model;
  if (o.parallel == "pipeline") {
    const int pp = o.stages > 0 ? o.stages : world.size();
    e.mesh = std::make_unique<parallel::Mesh>(world, world.size() / pp, pp);
    auto unit = [&](std::size_t u) {
      if (!device.is_cpu()) m.units()[u]->to(device);
      return m.units()[u];
    };
    const int v = o.virtual_stages;
    auto pipe = std::make_unique<parallel::Pipeline<T>>(
        *e.mesh, m.units().size(), unit, parallel::partition_balanced(unit_costs, pp * v),
        parallel::PipelineOptions<T>{
            .schedule = v > 1                  ? parallel::Schedule::Interleaved
                        : o.schedule == "gpipe" ? parallel::Schedule::GPipe
                                                : parallel::Schedule::OneFOneB,
            .micro_batches = o.micro_batches, .virtual_stages = v, .unit_names = m.unit_names(),
            .expert_parallel = o.expert_parallel});
    e.describe = detail::cat("pipeline of ", pp, " stages", v > 1 ? detail::cat(" x ", v, " chunks") : "",
                             " (units ", pipe->partition().str(), ") x ", e.mesh->dp_size(), " replica(s), ",
                             o.micro_batches, " micro-batches, ", schedule_label(o),
                             o.expert_parallel > 1 ? detail::cat(", ep ", o.expert_parallel) : "");
    e.gather = true;
    e.engine = std::move(pipe);
    return e;
  }
  parallel::Plan<T> plan = parallel::LocalOptions{};
  if (o.parallel == "ddp") plan = parallel::DDPOptions{.expert_parallel = o.expert_parallel};
  if (o.parallel == "cp") plan = parallel::ContextParallelPlan{.cp = o.context_parallel, .fsdp = o.cp_fsdp};
  if (o.parallel == "cp" && o.cp_tp)  // context parallelism inside tensor parallelism (docs/context_parallel.md)
    plan = parallel::TensorParallelPlan{
        .tp = o.tp, .fsdp = o.cp_fsdp ? std::optional<parallel::FSDPOptions>(parallel::FSDPOptions{}) : std::nullopt,
        .cp = o.context_parallel};
  if (o.parallel == "tp")
    plan = parallel::TensorParallelPlan{
        .tp = o.tp, .sequence_parallel = o.sequence_parallel, .pp = std::max(o.stages, 1),
        .micro_batches = o.stages > 1 ? o.micro_batches : 1,
        .schedule = o.schedule == "gpipe" ? parallel::Schedule::GPipe : parallel::Schedule::OneFOneB,
        .virtual_stages = o.virtual_stages, .unit_costs = unit_costs, .expert_parallel = o.expert_parallel};
  if (o.parallel == "fsdp") {
    if (o.fsdp_strategy == "hybrid" && o.hybrid_shard_size == 0)
      o.hybrid_shard_size = dist::detect_launch_env().local_world_size;
    parallel::FSDPOptions fo{.hybrid_shard_size = o.hybrid_shard_size, .device = device,
                             .expert_parallel = o.expert_parallel};
    for (auto st : {parallel::ShardingStrategy::FullShard, parallel::ShardingStrategy::ShardGradOp,
                    parallel::ShardingStrategy::ShardOptimizer, parallel::ShardingStrategy::NoShard,
                    parallel::ShardingStrategy::Hybrid})
      if (o.fsdp_strategy == parallel::strategy_name(st)) fo.strategy = st;
    plan = fo;
    if (o.fsdp_tp)  // FSDP x TP
      plan = parallel::TensorParallelPlan{.tp = o.tp, .sequence_parallel = o.sequence_parallel, .device = device,
                                          .fsdp = fo};
  } else if (!device.is_cpu()) {
    m.to(device);
  }
  e.engine = parallel::make_engine<T>(model, world, plan);
  if (auto* ddp = dynamic_cast<parallel::DDP<T>*>(e.engine.get()); ddp && ddp->expert_mesh()) {
    parallel::ExpertMesh& mesh = *ddp->expert_mesh();
    e.describe = detail::cat("expert parallel, ep ", mesh.ep_size(), " x dp ", mesh.dp_size());
    e.gather = true;  // rank 0's model lacks the other ranks' experts
  }
  if (auto* cp = dynamic_cast<parallel::ContextParallel<T>*>(e.engine.get()))
    e.describe = detail::cat("context parallel, cp ", cp->mesh().cp_size(), " x dp ", cp->mesh().dp_size());
  if (auto* tp = dynamic_cast<parallel::TensorParallel<T>*>(e.engine.get())) {
    parallel::Mesh& mesh = tp->mesh();
    const bool cp = mesh.cp_size() > 1;  // --context-parallel with --tp
    e.describe = detail::cat(cp ? detail::cat("context parallel, cp ", mesh.cp_size(), " x ") : "tensor parallel, ",
                             "tp ", mesh.tp_size(), cp ? "" : detail::cat(" x pp ", mesh.pp_size()), " x dp ",
                             mesh.dp_size(), o.sequence_parallel ? ", sequence parallel" : "",
                             tp->fsdp() ? ", fsdp " + o.fsdp_strategy + (cp ? " over dp x cp" : " over dp") : "",
                             tp->pipeline() ? " (units " + tp->pipeline()->partition().str() + ")" : "",
                             tp->expert_mesh() ? detail::cat(", ep ", tp->expert_mesh()->ep_size()) : "");
    e.gather = true;
  } else if (auto* fsdp = dynamic_cast<parallel::FSDP<T>*>(&e.engine->local_module())) {  // also cp's (--parallel fsdp)
    e.describe = detail::cat(e.describe.empty() ? "" : e.describe + ", ", fsdp->describe(), " over ", world.size(),
                             " rank(s) (shard groups of ", fsdp->shard_size(), ")");
    e.gather = true;
  }
  return e;
}

// Gives rank 0's model, before ckpt::gather_full_model fills it, every tensor on
// `device`: a pipeline's rank 0 holds only its own stage's units there, and expert
// parallelism under ddp, fsdp and pipeline keeps only this rank's experts in the model's MoE
// layers (each gets all of them back, their values from the gather).
template <class T, class M>
void make_whole(M& m, const GptEngine<T>& built, Device device) {
  if (built.mesh && !device.is_cpu())
    for (auto& unit : m.units())
      if (auto ps = unit->named_parameters(); !ps.empty() && !(ps[0].param->value.device() == device)) unit->to(device);
  for (nn::MoE<T>* moe : parallel::moe_layers(m)) {
    const nn::MoeConfig& c = moe->config();
    if (moe->experts().size() == c.num_experts) continue;
    Generator scratch(0);  // every value is overwritten
    auto all = std::make_shared<nn::MoeExperts<T>>(c.num_experts, c.n_embd, c.expert_hidden, scratch);
    if (!device.is_cpu()) all->to(device);
    moe->unshard_experts(std::move(all));
  }
}

// Everything a checkpoint must capture to resume this loop exactly (Note [gpt_char resume state]).
struct TrainState {
  std::int64_t step = 0;
  RandomWindows& windows;  // position() = batches taken by each rank
  std::vector<std::pair<std::string, Generator*>> streams;  // the model's dropout streams, named
  int replicas;            // a rank, or the stages of one pipeline
  std::int64_t batch;      // --batch: windows per batch
  nlohmann::json user;             // program, model and training flags (check_checkpoint_config)
};

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
//   started (0, or the resumed offset): the largest offset over the world is the stream's.
// - Parameters, AdamW moments and step count: ckpt::save and ckpt::load of the
//   engine (ckpt/engine_checkpoint.hpp), the same tensor names in every mode:
//   rank 0 writes the whole model (none, ddp), each shard group its pieces
//   (fsdp), replica 0 of each stage its stage (pipeline); any mode loads any of
//   them. The LR is schedule(step) of the flags' schedule; trainer.json keeps it for reference.

// The trainer state of a checkpoint (collective: the dropout offsets' maximum over the world).
ckpt::TrainerState checkpoint_state(TrainState& s, dist::Communicator& world, const optim::WarmupCosine& schedule) {
  ckpt::TrainerState ts;
  ts.sampler = ckpt::SamplerState{0, s.windows.position() * s.replicas * s.batch, s.replicas};
  const auto& streams = s.streams;
  std::vector<std::int64_t> offsets;
  for (const auto& [name, gen] : streams) offsets.push_back(static_cast<std::int64_t>(gen->offset()));
  world.all_reduce(offsets.data(), offsets.size(), DType::I64, dist::ReduceOp::Max);
  for (std::size_t i = 0; i < streams.size(); ++i)
    ts.rng["dropout/" + streams[i].first] = {streams[i].second->seed(), static_cast<std::uint64_t>(offsets[i])};
  ts.schedule = schedule;
  ts.user = s.user;
  return ts;
}

// --resume: refuses a checkpoint of another model (from trainer.json alone, so the
// model stays untouched), loads the newest one into the engine and the optimizer
// and restores the data position and dropout offsets; collective. Returns whether
// a checkpoint was loaded.
template <class T>
bool resume(ckpt::CheckpointManager& mgr, const ckpt::LatestCheckpoint& last, parallel::Engine<T>& engine,
            optim::AdamW<T>& opt, TrainState& s, const std::string& dir) {
  const bool lead = engine.communicator().rank() == 0;
  for (const auto& k : last.skipped)
    if (lead) std::fprintf(stderr, "gpt_char: skipping %s: %s\n", k.path.c_str(), k.reason.c_str());
  if (!last.found()) {
    if (lead) std::printf("no checkpoint in %s; starting from step 0\n", dir.c_str());
    return false;
  }
  const std::string path = last.path.string();
  std::string changed = check_checkpoint_config(ckpt::Checkpoint(last.path, false).trainer_state().user,
                                                s.user["model"], s.user["train"], path);
  const ckpt::TrainerState st = ckpt::load(mgr, last.path, engine, &opt);
  PTRAIN_CHECK(st.sampler.has_value(), CheckpointError, "[ptrain.example.config] ", path,
               " has no data position; it was not written by this program");
  const std::int64_t per_position = s.replicas * s.batch;  // global windows per position
  s.windows.set_position((st.sampler->consumed + per_position - 1) / per_position);
  for (auto& [name, gen] : s.streams) {
    const auto it = st.rng.find("dropout/" + name);
    PTRAIN_CHECK(it != st.rng.end(), CheckpointError, "[ptrain.example.config] ", path,
                 " has no offset for dropout stream '", name, "'; it was not written by this program");
    gen->set_offset(it->second.offset);
  }
  s.step = st.step;
  if (!lead) return true;
  std::printf("resumed from %s: step %lld (saved on %d rank(s))\n", path.c_str(), static_cast<long long>(s.step),
              st.world_size);
  const int world = engine.communicator().size();
  if (st.world_size != world)
    changed += (changed.empty() ? "" : ", ") + std::to_string(world) + " rank(s) (checkpoint: " +
               std::to_string(st.world_size) + ")";
  if (!changed.empty())
    std::printf("note: resuming with other settings than the checkpoint's: %s; training continues, but "
                "is not the bit-exact continuation\n", changed.c_str());
  return true;
}

// --checkpoint-dir: the manager, saves in the background, the final save and the
// one a signal asks for. Every call is collective.
template <class T>
class RunCheckpoints {
 public:
  RunCheckpoints(const Options& o, dist::Communicator& world) : o_(o), world_(world) {
    if (o.checkpoint_dir.empty()) return;
    mgr_ = std::make_unique<ckpt::CheckpointManager>(o.checkpoint_dir, &world,
                                                     ckpt::CheckpointOptions{.keep_last = o.keep_checkpoints});
    mgr_->check_writable();
    if (o.resume) last_ = mgr_->latest_to_resume(o.start_over);
  }
  /// Whether --resume found a checkpoint (which then replaces --init-from's weights).
  bool found() const { return last_.found(); }

  /// Resumes (--resume) into the engine, the optimizer and the state, which later saves
  /// write; returns whether a checkpoint was loaded.
  bool start(parallel::Engine<T>& engine, optim::AdamW<T>& opt, TrainState& state,
             const optim::WarmupCosine& schedule) {
    engine_ = &engine, opt_ = &opt, state_ = &state, schedule_ = schedule;
    if (!mgr_) return false;
    const bool resumed = o_.resume && resume(*mgr_, last_, engine, opt, state, o_.checkpoint_dir);
    last_saved_ = resumed ? state.step : -1;
    saver_ = std::make_unique<ckpt::AsyncCheckpointer>(*mgr_);
    preempt_ = std::make_unique<ckpt::PreemptionHandler>();
    return resumed;
  }

  /// After each step: the save of every --checkpoint-every steps (in the background:
  /// returns after a copy to host memory), and the signal check, one all-reduce, so
  /// that every rank stops at the same step when any got a signal. Returns true when
  /// the run must exit, with a checkpoint of this step committed.
  bool after_step() {
    if (!mgr_) return false;
    if (o_.checkpoint_every > 0 && state_->step % o_.checkpoint_every == 0) save(true);
    if (!preempt_->should_stop(&world_)) return false;
    saver_->wait();  // rank 0: the save in flight (perhaps of this very step) is committed
    if (last_saved_ != state_->step) save(false);
    else world_.barrier();  // a launcher stops every rank once one exits: not before rank 0 commits
    if (world_.rank() == 0) {
      std::printf("signal %d: checkpoint of step %lld committed in %s; exiting\n", preempt_->signal(),
                  static_cast<long long>(state_->step), o_.checkpoint_dir.c_str());
      std::fflush(stdout);  // the launcher's SIGTERM may come before exit() flushes a pipe
    }
    return true;
  }

  /// The final checkpoint, before evaluation and sampling, which change no training state.
  void finish() {
    if (!mgr_) return;
    saver_->wait();
    if (last_saved_ != state_->step) save(false);
  }

 private:
  void save(bool background) {
    const ckpt::TrainerState ts = checkpoint_state(*state_, world_, schedule_);
    if (background) ckpt::save(*saver_, *mgr_, state_->step, *engine_, opt_, ts);
    else ckpt::save(*mgr_, state_->step, *engine_, opt_, ts);
    last_saved_ = state_->step;
  }

  const Options& o_;
  dist::Communicator& world_;
  std::unique_ptr<ckpt::CheckpointManager> mgr_;
  ckpt::LatestCheckpoint last_;
  parallel::Engine<T>* engine_ = nullptr;
  optim::AdamW<T>* opt_ = nullptr;
  TrainState* state_ = nullptr;
  optim::WarmupCosine schedule_;
  std::int64_t last_saved_ = -1;
  std::unique_ptr<ckpt::AsyncCheckpointer> saver_;  // after mgr_: destroyed (and drained) first
  std::unique_ptr<ckpt::PreemptionHandler> preempt_;
};

// --export and --export-hf, on rank 0, of the whole model.
template <class K, class T>
void export_model(const Options& o, typename K::Model& model, const Corpus& corpus, std::int64_t step) {
  if (!o.export_path.empty()) {
    std::vector<ckpt::TensorRef> refs;
    std::vector<Tensor<T>> host;  // the file is written from host memory
    for (auto& p : model.named_parameters()) host.push_back(p.param->value.to(Device::cpu()));
    std::size_t i = 0;
    for (auto& p : model.named_parameters()) refs.push_back(ckpt::tensor_ref(p.name, host[i++]));
    ckpt::write_safetensors(o.export_path, refs, {{"format", "pt"}, {"ptrain.step", std::to_string(step)}});
    std::printf("exported %zu tensors of step %lld to %s\n", refs.size(), static_cast<long long>(step),
                o.export_path.c_str());
  }
  if (!o.export_hf.empty()) {
    // The tokenizer's vocabulary (not the padded one) and its files: a folder transformers loads whole.
    const std::string what = K::save_hf(o.export_hf, model, corpus.tok ? corpus.tok->vocab_size() : 0);
    for (const char* f : {"vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "tokenizer.model"})
      if (corpus.tok && std::filesystem::is_regular_file(std::filesystem::path(o.tokenizer) / f))
        std::filesystem::copy_file(std::filesystem::path(o.tokenizer) / f, std::filesystem::path(o.export_hf) / f,
                                   std::filesystem::copy_options::overwrite_existing);
    std::printf("exported step %lld to %s as %s\n", static_cast<long long>(step),
                o.export_hf.c_str(), what.c_str());
  }
}

// The sample at the end, on rank 0. Token files without --tokenizer: it continues the
// first validation token and is printed as ids. A padded vocabulary's extra ids are never sampled.
template <class M>
void print_sample(const Options& o, M& model, const Corpus& corpus) {
  const bool text = corpus.can_encode();
  const std::vector<std::int32_t> prompt =
      text ? corpus.encode(o.prompt) : std::vector<std::int32_t>{static_cast<std::int32_t>(corpus.val.at(0, 0))};
  Generator sample_gen(o.seed);
  const auto out = nn::generate(model, prompt, o.sample_tokens, o.temperature, o.top_k, sample_gen,
                                corpus.tok ? corpus.tok->vocab_size() : 0);
  std::string sample;
  if (text) sample = corpus.decode(out);
  else
    for (std::int32_t t : out) sample += (sample.empty() ? "" : " ") + std::to_string(t);
  std::printf("--- sample%s ---\n%s\n--------------\n", text ? "" : " (token ids)", sample.c_str());
}

}  // namespace

// Why --device cuda --cuda-graphs on cannot capture this run's step (empty: it can;
// Note [CUDA graphs of the step] in ptrain/train/step_graph.hpp).
template <class T>
std::string cuda_graph_blocker(const Options& o, parallel::Engine<T>& engine, Device device) {
  if (o.cuda_graphs != "on" || !device.is_cuda()) return "not asked for";
  if (!kernels::cuda_kernel_enabled("cuda_graph_step"))
    return "cuda_graph_step is gated (ptrain/kernels/cuda_unverified.hpp; PTRAIN_UNVERIFIED_CUDA=1 runs it)";
  if (engine.mode() != parallel::Mode::Local && engine.mode() != parallel::Mode::DDP &&
      engine.mode() != parallel::Mode::FSDP)
    return "the engine computes its loss its own way";
  if (engine.mode() == parallel::Mode::FSDP && o.grad_clip > 0)
    return "an FSDP norm spans the shards, which Engine::clip_grad_norm_ sums on the host (--grad-clip 0 captures)";
  dist::Communicator* dp = engine.data_parallel_group();
  if (engine.mode() != parallel::Mode::Local &&
      (!engine.communicator().graph_capturable() || (dp && !dp->graph_capturable())))
    return "the engine's collectives go through host memory (MPI, Gloo); NCCL's can be captured";
  if (o.dropout > 0) return "dropout draws its masks on the host, which a replay would repeat";
  return {};
}

// The training run in element type T (float, or bf16 with --precision bf16) of
// the model K describes (Note [gpt_char models]).
template <class T, class K>
int run(Options opt) {
  try {
    Stopwatch wall;
    // cuda: the GPU of this rank's LOCAL_RANK (0 without a launcher), NCCL between ranks.
    PTRAIN_CHECK(opt.device == "cpu" || kernels::cuda_kernels_linked(), Error, "[ptrain.example.device] "
                 "--device cuda needs gpt_char_cuda, this program linked with ptrain::cuda (a CUDA toolkit at "
                 "configure time, PTRAIN_WITH_CUDA=AUTO or ON)");
    const Device device = opt.device == "cuda" ? Device::cuda(dist::detect_launch_env().local_rank) : Device::cpu();
    apply_observe_flags(opt.observe);
    std::unique_ptr<dist::Communicator> world = std::make_unique<dist::SelfCommunicator>(device);
    if (opt.parallel != "none") world = dist::init_process_group({.device = device});
    const int rank = world->rank();
    const bool lead = rank == 0;
    check_parallel_flags(opt, world->size());
    // Ranks of one node would oversubscribe the cores with a thread pool each.
    if (opt.threads > 0 || opt.parallel != "none") kernels::cpu::set_num_threads(opt.threads > 0 ? opt.threads : 1);

    const Corpus corpus = load_corpus(opt);
    const double entropy = corpus.entropy;
    if (lead && corpus.chars && !opt.save_tokenizer.empty()) corpus.chars->save(opt.save_tokenizer);
    check_end_of_run(opt, corpus, lead);

    manual_seed(opt.seed);
    const typename K::Config cfg = K::config(opt, corpus.vocab_size, rank);
    auto model = std::make_shared<typename K::Model>(cfg);
    // Checkpoints (optional), found first: a checkpoint to resume replaces --init-from's weights.
    RunCheckpoints<T> checkpoints(opt, *world);
    if (!opt.init_from.empty() && !checkpoints.found()) {
      const std::string loaded = K::load(opt.init_from, *model);
      if (lead) std::printf("initialised from %s: %s\n", opt.init_from.c_str(), loaded.c_str());
    }
    const std::int64_t num_parameters = model->num_parameters();  // FSDP releases the model's tensors
    GptEngine<T> built = build_engine<T>(opt, model, K::unit_costs(cfg), *world, device);  // Note [gpt_char engines]
    parallel::Engine<T>& engine = *built.engine;
    dist::Communicator* dp = engine.data_parallel_group();  // replicas: a rank, or the stages of one pipeline
    const int replicas = dp ? dp->size() : 1;
    RandomWindows train_windows(corpus.train, opt.block, opt.seed, dp ? dp->rank() : 0, replicas, corpus.vocab_size);
    RandomWindows val_windows(corpus.val, opt.block, opt.seed + 1, 0, 1, corpus.vocab_size);
    // The same options and decay filter in every mode: FSDP's local entries carry
    // the parameter names (1-D pieces of them), and the filter decides by name.
    // --cuda-graphs (Note [CUDA graphs of the step] in ptrain/train/step_graph.hpp): the
    // step never waits for the host, so AdamW clips on the device (max_grad_norm: the
    // same coefficient as clip_grad_norm_) and the loss stays there between progress lines.
    std::string graphs_off = cuda_graph_blocker(opt, engine, device);
    const bool graph_loop = graphs_off.empty();
    optim::AdamW<T> optimizer(engine.parameters(),
                              {.lr = opt.lr, .beta2 = 0.99, .weight_decay = opt.weight_decay,
                               .max_grad_norm = graph_loop ? opt.grad_clip : 0.0},
                              K::decay_filter());
    if (graph_loop && !optimizer.use_device_scalars(true))
      graphs_off = "AdamW's one-launch update is gated (PTRAIN_UNVERIFIED_CUDA=1 runs it)";
    if (lead && device.is_cuda() && opt.cuda_graphs == "on" && !graphs_off.empty())
      std::printf("CUDA graphs off: %s\n", graphs_off.c_str());
    const optim::WarmupCosine schedule{.base_lr = opt.lr, .warmup = opt.warmup, .total = opt.steps,
                                       .min_lr = opt.min_lr};
    TrainState state{0, train_windows, K::dropout_streams(*model), replicas, opt.batch,
                        {{"program", "gpt_char"}, {"model", K::flags(cfg, opt)},
                         {"train", train_flags(opt, world->size())}}};
    // Resume before training, so that metrics append to the resumed run's file.
    const bool resumed = checkpoints.start(engine, optimizer, state, schedule);

    MetricsWriter metrics(lead ? opt.metrics : "", resumed, lead ? opt.observe.tensorboard_dir : "");
    obs::Tracer& tracer = obs::Tracer::get();
    tracer.configure_from_env(rank);
    const char* unit = corpus.chars ? "char" : "token";
    Progress progress(opt.steps, lead ? opt.log_every : 0, std::cout, state.step);
    const double tokens_per_step = static_cast<double>(opt.batch * opt.grad_accum * opt.block * replicas);
    if (lead) {
      std::printf("%s, vocabulary %lld, unigram entropy %.4f nats/%s\n", corpus.describe.c_str(),
                  static_cast<long long>(corpus.vocab_size), entropy, unit);
      std::printf("model %s: %lld parameters, %.1f MFLOP/token; %lld steps of %.0f tokens on %d rank(s)\n",
                  model->describe().c_str(), static_cast<long long>(num_parameters),
                  cfg.flops_per_token(opt.block) / 1e6, static_cast<long long>(opt.steps), tokens_per_step,
                  world->size());
      std::printf("device %s, precision %s\n", device.str().c_str(), opt.precision.c_str());
      if (!built.describe.empty()) std::printf("parallel: %s\n", built.describe.c_str());
      metrics.write({{"event", "config"}, {"vocab_size", corpus.vocab_size}, {"train_tokens", corpus.train.size()},
                     {"parameters", num_parameters}, {"unigram_entropy", entropy}, {"world_size", world->size()},
                     {"start_step", state.step}});
    }

    Tensor<std::int32_t> x, y;
    double val_loss = 0;
    // Mean loss over --eval-batches fixed windows of the validation split, in evaluation
    // mode; every rank evaluates (the forward of fsdp and pipeline is collective).
    auto validate = [&] {
      engine.train(false);
      val_windows.set_position(0);
      double total = 0;
      for (std::int64_t b = 0; b < opt.eval_batches; ++b) {
        val_windows.next(opt.batch, x, y);
        total += engine.eval_loss(x.to(device), y.to(device));
      }
      engine.train(true);
      val_loss = engine.average(total / static_cast<double>(opt.eval_batches));
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
      {
        obs::Span span("data", "train");
        train_windows.next(opt.batch, x, y);
      }
      obs::Span span("forward_backward", "train");
      // The loss trained: the cross entropy plus a mixture of experts' auxiliary losses
      // (with --grad-accum M their coefficients are already 1/M: their sum over the M
      // batches is the mean's share).
      const double ce = engine.forward_backward(x.to(device), y.to(device), 1.0 / opt.grad_accum);
      return ce + K::aux_loss(*model) * opt.grad_accum;
    };
    // The step with the loss on the device, captured and replayed once the shapes are fixed.
    train::LossWindow losses;
    train::StepGraphPlan plan(1);
    if (!graphs_off.empty()) plan.turn_off(graphs_off);
    train::CudaStepGraph graph;
    std::vector<Tensor<std::int32_t>> gx(static_cast<std::size_t>(opt.grad_accum)), gy(gx.size());  // its inputs
    if (graph_loop) engine.set_loss(parallel::device_cross_entropy<T>(losses.step()));
    std::int64_t window_steps = 0;  // steps since the last progress line
    auto device_step = [&] {
      for (std::size_t k = 0; k < gx.size(); ++k) {
        obs::Span span("data", "train");
        train_windows.next(opt.batch, x, y);
        if (!gx[k].defined()) {
          gx[k] = x.to(device);
          gy[k] = y.to(device);
        } else {  // into the graph's inputs, without waiting for the device
          kernels::cuda_graph_calls().upload(gx[k].data(), x.data(), x.numel() * sizeof(std::int32_t), device.index);
          kernels::cuda_graph_calls().upload(gy[k].data(), y.data(), y.numel() * sizeof(std::int32_t), device.index);
        }
      }
      auto body = [&] {
        losses.begin_step();
        engine.zero_grad();
        for (std::size_t k = 0; k < gx.size(); ++k) {
          obs::Span span("forward_backward", "train");
          if (k + 1 < gx.size()) {
            auto local = engine.no_sync();
            engine.forward_backward(gx[k], gy[k], 1.0 / opt.grad_accum);
          } else {
            engine.forward_backward(gx[k], gy[k], 1.0 / opt.grad_accum);
          }
        }
        engine.step(optimizer);
        losses.end_step();
      };
      train::StepGraphKey key;
      key.add_shape(gx[0].shape());
      const auto action = plan.next(key);
      if (!plan.off()) optimizer.stage_device_scalars();
      if (action == train::StepGraphPlan::Action::Eager) return body();
      if (action == train::StepGraphPlan::Action::Replay) {
        graph.launch();
        optimizer.count_replayed_step();
        return;
      }
      const std::int64_t steps_before = optimizer.steps();
      std::string failed;
      try {
        if (!graph.defined()) graph = train::CudaStepGraph(device.index);
        graph.capture("gpt_char's step", body);
      } catch (const Error& e) {
        failed = e.what();
      }
      std::int32_t any_failed = failed.empty() ? 0 : 1;  // every rank keeps its graph, or none does
      if (world->size() > 1) world->all_reduce(&any_failed, 1, DType::I32, dist::ReduceOp::Max);
      if (any_failed) {
        if (failed.empty()) failed = "on another rank";
        plan.turn_off(failed);
        (void)optimizer.use_device_scalars(false);
        optimizer.set_steps(steps_before);
        if (lead) std::printf("CUDA graphs off: capturing the step failed: %s\n", failed.c_str());
        return body();
      }
      plan.captured();
      graph.launch();
    };
    while (state.step < opt.steps) {
      tracer.step(state.step + 1);
      optimizer.set_lr(schedule(state.step));
      if (graph_loop) {
        device_step();
        ++state.step;
        ++window_steps;
        // The loss of the steps since the last line, read once per line (Note [Loss on the device]).
        const bool report = opt.log_every > 0 && (state.step % opt.log_every == 0 || state.step == opt.steps);
        const double sum = report ? losses.sum() : 0.0;
        progress.update(state.step, 1, sum, optimizer.lr(), static_cast<std::int64_t>(tokens_per_step));
        if (report) {
          const double mean = engine.average(sum / static_cast<double>(window_steps));
          losses.reset();
          window_steps = 0;
          if (lead)
            metrics.write({{"step", state.step}, {"loss", mean}, {"lr", optimizer.lr()},
                           {"data_position", train_windows.position()}});
        }
        if (opt.eval_every > 0 && state.step % opt.eval_every == 0 && state.step < opt.steps) validate();
        if (checkpoints.after_step()) return opt.preempt_exit_code;
        continue;
      }
      engine.zero_grad();
      double loss = 0;
      for (int k = 1; k < opt.grad_accum; ++k) {  // all but the last batch add up locally
        auto local = engine.no_sync();
        loss += accumulate();
      }
      loss = engine.average((loss + accumulate()) / opt.grad_accum);  // the last backward reduces the sum
      const double norm = opt.grad_clip > 0 ? engine.clip_grad_norm_(opt.grad_clip) : 0.0;
      {
        obs::Span span("optimizer_step", "train");
        engine.step(optimizer);
      }
      ++state.step;
      progress.update(state.step, 1, loss, optimizer.lr(), static_cast<std::int64_t>(tokens_per_step));
      if (!opt.metrics.empty() || !opt.observe.tensorboard_dir.empty())
        parallel::all_reduce_moe_stats(*model, *world);  // the MoE routing over all ranks (docs/moe.md)
      if (lead) {
        nlohmann::json rec = {{"step", state.step}, {"loss", loss}, {"lr", optimizer.lr()}, {"grad_norm", norm},
                              {"data_position", train_windows.position()}};
        // What the model reports (MoE routing since the previous record: every rank's, summed above).
        for (const auto& [name, value] : model->named_metrics()) rec[name] = value;
        metrics.write(rec);
      }
      if (opt.eval_every > 0 && state.step % opt.eval_every == 0 && state.step < opt.steps) validate();
      if (checkpoints.after_step()) return opt.preempt_exit_code;
    }
    if (graph_loop) (void)losses.sum();  // a bad target of the last steps surfaces here
    tracer.flush();
    checkpoints.finish();
    validate();
    // Sampling and --export need the whole parameters in rank 0's model (Note [gpt_char engines]).
    if (built.gather && (opt.sample_tokens > 0 || !opt.export_path.empty() || !opt.export_hf.empty())) {
      if (lead) make_whole<T>(*model, built, device);
      ckpt::gather_full_model(*built.engine, *model);
    }
    if (lead) {
      export_model<K, T>(opt, *model, corpus, state.step);
      if (opt.sample_tokens > 0) print_sample(opt, *model, corpus);
      const double secs = wall.seconds();
      std::printf("final val_loss %.4f nats/%s = %.3f x unigram entropy %.4f; wall time %.1f s\n", val_loss, unit,
                  val_loss / entropy, entropy, secs);
      metrics.write({{"event", "final"}, {"step", state.step}, {"val_loss", val_loss}, {"unigram_entropy", entropy},
                     {"wall_s", secs}});
    }
  } catch (const Error& e) {
    dist::record_error(e);  // for the launcher's TORCHELASTIC_ERROR_FILE (torchrun, ptrun)
    std::fprintf(stderr, "gpt_char: %s\n", e.what());
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"Train a GPT or a Llama with ptrain on the characters of a text or on token files"};
  app.add_option("--model", opt.model, "gpt (GPT-2 blocks), llama (RMSNorm, grouped-query attention with rotary "
                 "positions, SwiGLU) or mixtral (a llama whose MLPs are mixtures of SwiGLU experts)")
      ->check(CLI::IsMember({"gpt", "llama", "mixtral"}));
  auto* experts = app.add_option("--experts", opt.experts, "--model mixtral: experts per MoE layer")->check(positive);
  auto* moe_top_k = app.add_option("--moe-top-k", opt.moe_top_k, "--model mixtral: experts per token (--top-k is "
                                   "the sample's)")->check(positive);
  auto* moe_every = app.add_option("--moe-every", opt.moe_every, "--model mixtral: every n-th block has experts "
                                   "(1: all)")->check(positive);
  auto* capacity = app.add_option("--capacity-factor", opt.capacity_factor, "--model mixtral: each expert keeps "
                                  "ceil(factor * tokens * k / experts) slots, the rest dropped (0: dropless)")
                       ->check(non_negative);
  auto* aux_coef = app.add_option("--aux-loss-coef", opt.aux_loss_coef, "--model mixtral: load-balancing loss "
                                  "coefficient")->check(non_negative);
  auto* z_coef = app.add_option("--z-loss-coef", opt.z_loss_coef, "--model mixtral: router z-loss coefficient")
                     ->check(non_negative);
  app.add_option("--expert-parallel", opt.expert_parallel, "--model mixtral --parallel ddp, fsdp, tp or pipeline: "
                 "split each MoE layer's experts over this many ranks (a divisor of the world and of --experts; world / it replicas)")
      ->check(positive);
  app.add_option("--kv-heads", opt.n_kv_head, "--model llama: key/value heads, dividing --heads (default: --heads)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--intermediate", opt.intermediate, "--model llama: SwiGLU width (default: 8/3 of --embd, rounded "
                 "up to a multiple of 32)")->check(CLI::NonNegativeNumber);
  app.add_option("--rope-theta", opt.rope_theta, "--model llama: base of the rotary frequencies")
      ->check(CLI::PositiveNumber);
  app.add_option("--document-token", opt.document_token, "--model llama: token id that starts each packed document "
                 "(e.g. <|endoftext|>): attention stays inside documents and positions restart (-1: off)");
  auto* data = app.add_option("--data", opt.data, "plain-text file (default: the fortunes corpus in "
                              "/usr/share/games/fortunes)");
  auto* train_tokens = app.add_option("--train-tokens", opt.train_tokens, "token files to train on instead of text: "
                                      "nanoGPT's train.bin or llm.c's shards (paths or quoted glob patterns)");
  auto* val_tokens = app.add_option("--val-tokens", opt.val_tokens, "token files to validate on (with --train-tokens)");
  auto* vocab = app.add_option("--vocab-size", opt.vocab_size, "vocabulary of the token files, or padded above "
                               "--tokenizer's (e.g. 50304 for GPT-2's 50257 ids)")->check(positive);
  auto* tokenizer = app.add_option("--tokenizer", opt.tokenizer, "a tokenizer's folder or file (GPT-2's "
                                   "vocab.json + merges.txt, tokenizer.json, tiktoken ranks or a SentencePiece model): "
                                   "--data as its tokens, --prompt and the sample of token files as text");
  app.add_option("--token-format", opt.token_format, "u16 or i32: ids of raw token files (llm.c shards say theirs)")
      ->check(CLI::IsMember({"u16", "i32"}));
  train_tokens->needs(val_tokens)->excludes(data);
  val_tokens->needs(train_tokens);
  app.add_option("--parallel", opt.parallel, "none, ddp, fsdp, pipeline, tp or cp (under mpirun or ptrun)")
      ->check(CLI::IsMember({"none", "ddp", "fsdp", "pipeline", "tp", "cp"}));
  app.add_option("--tp", opt.tp, "with --parallel tp: ranks per tensor-parallel group (a divisor of n_head and of "
                 "the world; world / tp replicas); with --parallel fsdp: FSDP x TP, each tp shard sharded over "
                 "the replicas; with --context-parallel: the tp ranks of each slice of the sequence")->check(positive);
  app.add_flag("--sequence-parallel", opt.sequence_parallel, "with --parallel tp: cut the activations between the "
               "tensor-parallel layers along the sequence (--block a multiple of --tp)");
  app.add_option("--context-parallel", opt.context_parallel, "split each sequence over this many ranks (ring "
                 "attention; --block a multiple of 2x it; world / it replicas); the same as --parallel cp; "
                 "with --parallel fsdp the weights are sharded over all the ranks")
      ->check(positive);
  app.add_option("--device", opt.device, "cpu, or cuda: the GPU of LOCAL_RANK, NCCL between ranks (gpt_char_cuda)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--cuda-graphs", opt.cuda_graphs, "on: with --device cuda (one rank, or ddp/fsdp over NCCL), keep "
                 "the loss on the GPU between progress lines and capture the whole step in a CUDA graph after a warm-up step, then "
                 "replay it; off: launch every kernel each step")->check(CLI::IsMember({"on", "off"}));
  app.add_option("--precision", opt.precision, "fp32, or bf16: bf16 parameters and activations with fp32 master "
                 "weights")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--fsdp-strategy", opt.fsdp_strategy, "with --parallel fsdp: full_shard (ZeRO-3), shard_grad_op "
                 "(ZeRO-2), shard_optimizer (ZeRO-1), no_shard, or hybrid")
      ->check(CLI::IsMember({"full_shard", "shard_grad_op", "shard_optimizer", "no_shard", "hybrid"}));
  app.add_option("--hybrid-shard-size", opt.hybrid_shard_size, "ranks per shard group of --fsdp-strategy hybrid "
                 "(0: the launcher's ranks per node)")->check(non_negative);
  app.add_option("--stages", opt.stages, "with --parallel pipeline: stages per replica; the ranks form "
                 "world / stages replicas (0: one stage per rank); with --parallel tp: pipeline stages of "
                 "tensor-parallel units (0 or 1: none), world / (tp * stages) replicas")->check(non_negative);
  app.add_option("--micro-batches", opt.micro_batches, "with --parallel pipeline: micro-batches per --batch")
      ->check(positive);
  app.add_option("--schedule", opt.schedule, "with --parallel pipeline: 1f1b or gpipe")
      ->check(CLI::IsMember({"1f1b", "gpipe"}));
  app.add_option("--virtual-stages", opt.virtual_stages, "with --parallel pipeline: model chunks per stage; above 1 "
                 "runs the interleaved 1F1B schedule (a smaller bubble, more activations and messages; "
                 "--micro-batches a multiple of the stages)")->check(positive);
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
  add_observe_flags(app, opt.observe);
  app.add_option("--init-from", opt.init_from, "start from pretrained weights: a Hugging Face folder "
                 "(GPT-2, Llama, Mistral, Qwen2: config.json and model.safetensors), a GPT-2 model.safetensors, or a "
                 "ptrain file (--export, a checkpoint's model.safetensors)");
  app.add_option("--export", opt.export_path, "at the end, rank 0 writes the final parameters, whole, to this "
                 "safetensors file (PyTorch's safetensors.torch.load_file reads it)");
  app.add_option("--export-hf", opt.export_hf, "at the end, rank 0 writes the model as a Hugging Face folder "
                 "(GPT-2, or Llama/Mistral/Qwen2 for --model llama: model.safetensors, config.json, --tokenizer's "
                 "files) for transformers' from_pretrained");
  if (const int rc = parse_command_line(app, argc, argv); rc >= 0) return rc;
  if (!apply_run_dir("gpt_char", app, opt.observe, opt.metrics, opt.checkpoint_dir)) return 2;
  if (opt.context_parallel > 0 || opt.parallel == "cp") {
    opt.cp_fsdp = opt.parallel == "fsdp";  // FSDP (full_shard) over the dp x cp ranks
    if ((opt.parallel != "none" && opt.parallel != "cp" && !opt.cp_fsdp) ||
        (opt.cp_fsdp && opt.fsdp_strategy != "full_shard")) {
      std::fprintf(stderr, "gpt_char: --context-parallel is its own mode, with --parallel fsdp (full_shard), --tp, "
                   "both or alone; leave out --parallel %s --fsdp-strategy %s\n", opt.parallel.c_str(),
                   opt.fsdp_strategy.c_str());
      return 2;
    }
    opt.cp_tp = app.count("--tp") > 0;  // inside tensor parallelism
    opt.parallel = "cp";
    if (opt.context_parallel == 0) opt.context_parallel = 2;
  }
  opt.fsdp_tp = opt.parallel == "fsdp" && app.count("--tp") > 0;  // FSDP x TP (docs/tensor_parallel.md)
  if (opt.fsdp_tp && (opt.model == "mixtral" || opt.stages > 1)) {
    std::fprintf(stderr, "gpt_char: --parallel fsdp --tp (FSDP x TP) runs GPT and Llama without --stages\n");
    return 2;
  }
  if (opt.resume && opt.checkpoint_dir.empty()) {
    std::fprintf(stderr, "gpt_char: --resume needs --checkpoint-dir (or --run-dir)\n");
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

  const bool moe_flags = experts->count() + moe_top_k->count() + moe_every->count() + capacity->count() +
                            aux_coef->count() + z_coef->count() > 0;
  if (moe_flags && opt.model != "mixtral") {
    std::fprintf(stderr, "gpt_char: --experts, --moe-top-k, --moe-every, --capacity-factor, --aux-loss-coef and "
                 "--z-loss-coef are for --model mixtral\n");
    return 2;
  }
  if (opt.model == "mixtral" && (opt.parallel == "cp" || opt.fsdp_tp ||
                                  (opt.parallel == "tp" && (opt.stages > 1 || opt.sequence_parallel)))) {
    std::fprintf(stderr, "gpt_char: --model mixtral runs with --parallel none, ddp, pipeline, tp (--expert-parallel N "
                 "splits the experts; tp without --stages and --sequence-parallel) or fsdp without --tp (context "
                 "parallelism of MoE blocks is not built in gpt_char)\n");
    return 2;
  }
  if (opt.model == "llama" || opt.model == "mixtral") {
    if (opt.dropout != 0) {
      std::fprintf(stderr, "gpt_char: --model %s has no dropout (as Llama); leave out --dropout\n", opt.model.c_str());
      return 2;
    }
    return opt.precision == "bf16" ? run<bf16, LlamaKind<bf16>>(opt) : run<float, LlamaKind<float>>(opt);
  }
  if (opt.document_token >= 0 || opt.n_kv_head > 0 || opt.intermediate > 0) {
    std::fprintf(stderr, "gpt_char: --document-token, --kv-heads and --intermediate are for --model llama\n");
    return 2;
  }
  return opt.precision == "bf16" ? run<bf16, GptKind<bf16>>(opt) : run<float, GptKind<float>>(opt);
}
