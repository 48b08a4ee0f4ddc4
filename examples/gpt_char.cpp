// Trains a character-level GPT on plain text and prints validation loss and a sample.
//
//   build/examples/gpt_char                                   # the fortunes corpus, single process
//   build/examples/gpt_char --data input.txt --steps 5000     # any plain-text file
//   mpirun -np 2 build/examples/gpt_char --parallel ddp       # data parallel (also under ptrun)
//
// Data: Debian's `fortunes` package (/usr/share/games/fortunes, about 2.5 MB of
// English): every fortune file, in name order, without the "%" separator lines.
// The last 10% of the characters are the validation split. Metrics (--metrics)
// are JSON lines; evaluation lines carry val_loss and unigram_entropy (nats per
// character: the loss of the best context-free model).
//
// The state a checkpoint needs is all in TrainState below: step, the train
// windows' position, the dropout streams' offsets (model.generators()), the
// parameters and the optimizer state.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <ptrain/data/text.hpp>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/parallel/ddp.hpp>
#include <ptrain/ptrain.hpp>

using namespace ptrain;

namespace {

constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

struct Options {
  std::string data;  // empty: the fortunes corpus
  std::string parallel = "none";
  std::int64_t steps = 1500;
  std::int64_t batch = 16;  // per rank
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
  int threads = 0;  // 0: OpenBLAS's default alone, 1 per rank under --parallel ddp
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

// Everything a checkpoint must capture to resume this loop exactly.
struct TrainState {
  std::int64_t step = 0;
  RandomWindows* windows = nullptr;  // position() = batches taken
  nn::GPT<float>* model = nullptr;   // parameters; model->generators() = dropout stream offsets
  optim::AdamW<float>* optimizer = nullptr;
};

// Mean loss over eval_batches fixed windows of the validation split (eval mode).
double evaluate(nn::GPT<float>& model, RandomWindows& windows, std::int64_t batches, std::int64_t batch) {
  model.train(false);
  nn::CrossEntropyLoss<float> ce;
  Tensor<float> x;
  Tensor<std::int32_t> y;
  windows.set_position(0);
  double total = 0;
  for (std::int64_t b = 0; b < batches; ++b) {
    windows.next(batch, x, y);
    nn::Cache<float> c, lc;
    total += ce.forward(model.forward(x, c), y, lc);
  }
  model.train(true);
  return total / static_cast<double>(batches);
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"Train a character-level GPT with ptrain"};
  app.add_option("--data", opt.data, "plain-text file (default: the fortunes corpus in /usr/share/games/fortunes)");
  app.add_option("--parallel", opt.parallel, "none, or ddp (under mpirun or ptrun)")
      ->check(CLI::IsMember({"none", "ddp"}));
  app.add_option("--steps", opt.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--batch", opt.batch, "sequences per step and rank")->check(CLI::PositiveNumber);
  app.add_option("--block", opt.block, "context length")->check(CLI::PositiveNumber);
  app.add_option("--layers", opt.n_layer, "transformer blocks");
  app.add_option("--heads", opt.n_head, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--embd", opt.n_embd, "embedding width")->check(CLI::PositiveNumber);
  app.add_option("--dropout", opt.dropout, "dropout probability");
  app.add_option("--lr", opt.lr, "peak AdamW learning rate");
  app.add_option("--min-lr", opt.min_lr, "learning rate at the end of the cosine decay");
  app.add_option("--weight-decay", opt.weight_decay, "AdamW weight decay (matrices only)");
  app.add_option("--grad-clip", opt.grad_clip, "clip the global gradient norm (0: off)");
  app.add_option("--warmup", opt.warmup, "linear warmup steps");
  app.add_option("--eval-every", opt.eval_every, "validate every N steps (and at the end)");
  app.add_option("--eval-batches", opt.eval_batches, "validation batches");
  app.add_option("--seed", opt.seed, "seed for initialisation, windows and sampling");
  app.add_option("--metrics", opt.metrics, "write JSON-lines metrics to this file (rank 0)");
  app.add_option("--log-every", opt.log_every, "progress line every N steps (0: none)");
  app.add_option("--sample-tokens", opt.sample_tokens, "characters to generate at the end");
  app.add_option("--temperature", opt.temperature, "sampling temperature (0: greedy)");
  app.add_option("--top-k", opt.top_k, "sample among the k most likely characters (0: all)");
  app.add_option("--prompt", opt.prompt, "text the sample continues");
  app.add_option("--save-tokenizer", opt.save_tokenizer, "write the vocabulary (JSON) to this file");
  app.add_option("--threads", opt.threads, "GEMM threads per process (0: library default; 1 under ddp)");
  CLI11_PARSE(app, argc, argv);

  try {
    Stopwatch wall;
    std::unique_ptr<dist::Communicator> comm;
    if (opt.parallel == "ddp") comm = dist::init_process_group();
    const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
    const bool lead = rank == 0;
    // Ranks of one node would oversubscribe the cores with a thread pool each.
    if (opt.threads > 0 || comm) kernels::cpu::set_num_threads(opt.threads > 0 ? opt.threads : 1);

    const std::string text = opt.data.empty() ? fortunes_corpus() : read_text_file(opt.data);
    const CharTokenizer tok = CharTokenizer::fit(text);
    if (lead && !opt.save_tokenizer.empty()) tok.save(opt.save_tokenizer);
    const Tensor<std::int32_t> ids = tok.encode_tensor(text);
    const std::int64_t n = ids.numel(), n_val = n / 10;
    const double entropy = unigram_entropy(ids, tok.vocab_size());
    RandomWindows train_windows(ids.narrow(0, n - n_val), opt.block, opt.seed, rank, world);
    RandomWindows val_windows(ids.narrow(n - n_val, n_val), opt.block, opt.seed + 1);

    manual_seed(opt.seed);
    nn::GPTConfig cfg{.vocab_size = tok.vocab_size(), .block_size = opt.block, .n_layer = opt.n_layer,
                      .n_head = opt.n_head, .n_embd = opt.n_embd, .dropout = opt.dropout, .tie_weights = true,
                      .dropout_seed = opt.seed + static_cast<std::uint64_t>(rank)};
    nn::GPT<float> model(cfg);
    nn::FlatParameters<float> params(model);
    optim::AdamW<float> optimizer(params, {.lr = opt.lr, .beta2 = 0.99, .weight_decay = opt.weight_decay},
                                  nn::gpt_decay_filter());
    std::unique_ptr<parallel::DDP<float>> ddp;
    if (comm) ddp = std::make_unique<parallel::DDP<float>>(model, params, *comm);
    nn::Module<float>& net = ddp ? static_cast<nn::Module<float>&>(*ddp) : model;
    nn::CrossEntropyLoss<float> ce;
    const optim::WarmupCosine schedule{.base_lr = opt.lr, .warmup = opt.warmup, .total = opt.steps,
                                       .min_lr = opt.min_lr};

    MetricsWriter metrics(lead ? opt.metrics : "");
    Progress progress(opt.steps, lead ? opt.log_every : 0);
    const double tokens_per_step = static_cast<double>(opt.batch * opt.block * world);
    if (lead) {
      std::printf("corpus %s: %lld characters, vocabulary %lld, unigram entropy %.4f nats/char\n",
                  opt.data.empty() ? kFortunesDir : opt.data.c_str(), static_cast<long long>(n),
                  static_cast<long long>(tok.vocab_size()), entropy);
      std::printf("model %s: %lld parameters, %.1f MFLOP/token; %lld steps of %.0f tokens on %d rank(s)\n",
                  model.describe().c_str(), static_cast<long long>(model.num_parameters()),
                  cfg.flops_per_token(opt.block) / 1e6, static_cast<long long>(opt.steps), tokens_per_step, world);
      metrics.write({{"event", "config"}, {"vocab_size", tok.vocab_size()}, {"characters", n},
                     {"parameters", model.num_parameters()}, {"unigram_entropy", entropy}, {"world_size", world}});
    }

    TrainState state{0, &train_windows, &model, &optimizer};
    Tensor<float> x;
    Tensor<std::int32_t> y;
    nn::Cache<float> cache, loss_cache;
    double val_loss = 0;
    auto validate = [&] {
      val_loss = evaluate(model, val_windows, opt.eval_batches, opt.batch);
      if (ddp) val_loss = ddp->average(val_loss);  // identical on every rank; keeps collectives in step
      if (lead) {
        std::printf("step %lld: val_loss %.4f (%.3f x unigram entropy)\n", static_cast<long long>(state.step),
                    val_loss, val_loss / entropy);
        metrics.write({{"step", state.step}, {"val_loss", val_loss}, {"unigram_entropy", entropy},
                       {"val_loss_over_entropy", val_loss / entropy}});
      }
    };
    while (state.step < opt.steps) {
      train_windows.next(opt.batch, x, y);
      optimizer.set_lr(schedule(state.step));
      params.zero_grad();
      double loss = ce.forward(net.forward(x, cache), y, loss_cache);
      net.backward(ce.backward(loss_cache), cache);
      if (ddp) {
        ddp->finish_gradient_sync();
        loss = ddp->average(loss);
      }
      const double norm = opt.grad_clip > 0 ? optim::clip_grad_norm_(params.grads(), opt.grad_clip) : 0.0;
      optimizer.step();
      ++state.step;
      progress.update(state.step, 1, loss, optimizer.lr(), static_cast<std::int64_t>(tokens_per_step));
      if (lead)
        metrics.write({{"step", state.step}, {"loss", loss}, {"lr", optimizer.lr()}, {"grad_norm", norm},
                       {"data_position", train_windows.position()}});
      if (opt.eval_every > 0 && state.step % opt.eval_every == 0 && state.step < opt.steps) validate();
    }
    validate();

    if (lead) {
      Generator sample_gen(opt.seed);
      const auto out = nn::generate(model, tok.encode(opt.prompt), opt.sample_tokens, opt.temperature, opt.top_k,
                                    sample_gen);
      std::printf("--- sample ---\n%s\n--------------\n", tok.decode(out).c_str());
      const double secs = wall.seconds();
      std::printf("final val_loss %.4f nats/char = %.3f x unigram entropy %.4f; wall time %.1f s\n", val_loss,
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
