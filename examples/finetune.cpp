// Fine-tunes a Hugging Face Llama-family model on instruction records (JSON lines)
// with LoRA adapters, on one process, data parallel or fully sharded over the
// launched ranks, and writes the adapter in PEFT's format or a merged model folder.
//
//   build/examples/finetune --model SmolLM-135M --data train.jsonl --out adapter
//   build/launcher/ptrun --nproc-per-node 2 build/examples/finetune --model M --data train.jsonl
//       --parallel fsdp --out adapter --merged merged-model --sample "What is LoRA?"   (one line)
//
// --model is a folder with config.json, the weights and the tokenizer (tokenizer.json,
// or Llama 3's tiktoken ranks as tokenizer.model). --data holds {"prompt", "completion"}
// or {"messages": [...]} records (data/instruct.hpp); the last --eval-fraction of them
// is held out, and its loss (answer tokens only) is reported after each epoch. Records
// are rendered with the Llama 3 chat template (--template plain: prompt + answer +
// end of text) and packed into rows of --seq-len tokens (--layout padded: one per row).
// The loss counts answer tokens only, a token-weighted mean over the global batch.
//
// LoRA: --lora-r (0: train every parameter), --lora-alpha, --lora-dropout and
// --lora-targets (PEFT's target_modules). --out writes adapter_model.safetensors +
// adapter_config.json (PEFT's PeftModel.from_pretrained loads it onto the same base);
// --merged writes a Hugging Face folder with the adapters merged into the weights
// and the tokenizer's files. Checkpoints and resume as in fashion_mnist
// (--checkpoint-dir, --resume; docs/checkpointing.md).
//
// --check-answers N: after training, greedy answers to the first N training records'
// prompts, compared token for token with their answers; --min-answer-accuracy A
// exits with status 3 when fewer than A of them are right. docs/finetuning.md has
// the recipe, memory per rank and the Kubernetes launch.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <ptrain/data/instruct.hpp>
#include <ptrain/nn/models/peft.hpp>
#include <ptrain/ptrain.hpp>
#include <ptrain/train/trainer.hpp>

#include "checkpoint_flags.hpp"
#include "cli_checks.hpp"
#include "observe_flags.hpp"

using namespace ptrain;

namespace {

struct Options {
  std::string model, data, out, merged;
  double eval_fraction = 0.1;
  std::string chat_template = "llama3";
  std::string layout = "packed";
  std::int64_t seq_len = 512;
  std::int64_t lora_r = 8;
  double lora_alpha = 16;
  double lora_dropout = 0.0;
  std::vector<std::string> lora_targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"};
  int epochs = 3;
  std::int64_t batch = 4;
  int grad_accum = 1;
  double lr = 2e-4;
  double weight_decay = 0.0;
  std::uint64_t seed = 0;
  std::string parallel = "none";
  std::vector<std::string> samples;
  std::int64_t sample_tokens = 64;
  std::int64_t check_answers = 0;
  double min_answer_accuracy = 0.0;
  std::string metrics;
  std::int64_t log_every = 10;
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;
  int keep_checkpoints = 3;
  int preempt_exit_code = 0;
  bool resume = false;
  bool start_over = false;
};

// The loss of the held-out rows, answer tokens only: the sum of -log p(target) over
// every rank's rows divided by their count. Each data-parallel rank scores a
// contiguous part of the rows in the same number of forward calls (FSDP's forward is
// collective); a rank with no rows left runs row 0 and does not count it.
double eval_loss(parallel::Engine<float>& engine, InstructDataset<float>& data, std::int64_t batch) {
  dist::Communicator* dp = engine.data_parallel_group();
  const int rank = dp ? dp->rank() : 0, world = dp ? dp->size() : 1;
  const std::int64_t n = data.size(), lo = n * rank / world, hi = n * (rank + 1) / world;
  const std::int64_t calls = ((n + world - 1) / world + batch - 1) / batch;
  nn::Module<float>& module = engine.local_module();
  module.train(false);
  double sums[2] = {0, 0};  // loss, answer tokens
  for (std::int64_t c = 0; c < calls; ++c) {
    const std::int64_t begin = lo + (hi - lo) * c / calls, len = lo + (hi - lo) * (c + 1) / calls - begin;
    std::vector<std::int64_t> rows;
    for (std::int64_t i = 0; i < std::max<std::int64_t>(len, 1); ++i) rows.push_back(len ? begin + i : 0);
    const Batch<float> b = data.get(rows);
    nn::Cache<float> cache;
    const auto logits = module.forward_tokens(b.ids, cache);
    if (!len) continue;
    Tensor<float> lse;
    std::int64_t valid = 0;
    const double mean = ops::cross_entropy(logits, b.targets.ids().to(logits.device()), lse, valid);
    sums[0] += mean * static_cast<double>(valid);
    sums[1] += static_cast<double>(valid);
  }
  module.train(true);
  if (dp) dp->all_reduce(sums, 2, DType::F64, dist::ReduceOp::Sum);
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

// The prompt of a record (everything before its last answer) and that answer, with
// its closing token: what a greedy continuation of the prompt should produce.
std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> prompt_and_answer(const TokenizedRecord& r) {
  std::size_t start = r.ids.size();
  while (start > 0 && !r.answer[start - 1]) --start;  // past a trailing non-answer (none in a valid record)
  std::size_t end = start;
  while (start > 0 && r.answer[start - 1]) --start;
  return {{r.ids.begin(), r.ids.begin() + static_cast<std::ptrdiff_t>(start)},
          {r.ids.begin() + static_cast<std::ptrdiff_t>(start), r.ids.begin() + static_cast<std::ptrdiff_t>(end)}};
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"Fine-tune a Hugging Face Llama-family model on instruction records with LoRA"};
  app.add_option("--model", opt.model, "Hugging Face model folder: config.json, weights, tokenizer")->required();
  app.add_option("--data", opt.data, "JSON-lines instruction records (prompt/completion or messages)")->required();
  app.add_option("--out", opt.out, "write the LoRA adapter here (PEFT's adapter folder)");
  app.add_option("--merged", opt.merged, "write a Hugging Face folder with the adapters merged in here");
  app.add_option("--eval-fraction", opt.eval_fraction, "the last fraction of the records held out for evaluation")
      ->check(CLI::Range(0.0, 0.9));
  app.add_option("--template", opt.chat_template, "llama3 (Meta's chat template) or plain")
      ->check(CLI::IsMember({"llama3", "plain"}));
  app.add_option("--layout", opt.layout, "packed (several records per row) or padded (one record per row)")
      ->check(CLI::IsMember({"packed", "padded"}));
  app.add_option("--seq-len", opt.seq_len, "tokens per row")->check(positive);
  app.add_option("--lora-r", opt.lora_r, "LoRA rank (0: train every parameter, no adapters)")->check(non_negative);
  app.add_option("--lora-alpha", opt.lora_alpha, "LoRA alpha: the update is scaled by alpha / r")->check(positive);
  app.add_option("--lora-dropout", opt.lora_dropout, "dropout on the adapters' input")->check(CLI::Range(0.0, 0.99));
  app.add_option("--lora-targets", opt.lora_targets, "module names to adapt (PEFT's target_modules)")
      ->delimiter(',');
  app.add_option("--epochs", opt.epochs, "passes over the training records")->check(positive);
  app.add_option("--batch", opt.batch, "rows per rank per step")->check(positive);
  app.add_option("--grad-accum", opt.grad_accum, "micro-batches per step")->check(positive);
  app.add_option("--lr", opt.lr, "AdamW learning rate (cosine decay to 0 after 3% warmup)")->check(positive);
  app.add_option("--weight-decay", opt.weight_decay, "AdamW decoupled weight decay")->check(non_negative);
  app.add_option("--seed", opt.seed, "seed for the adapters' initialisation and the data order");
  app.add_option("--parallel", opt.parallel, "none, ddp or fsdp over the launched ranks")
      ->check(CLI::IsMember({"none", "ddp", "fsdp"}));
  app.add_option("--sample", opt.samples, "after training, answer this user message (repeatable)");
  app.add_option("--sample-tokens", opt.sample_tokens, "tokens per --sample answer at most")->check(positive);
  app.add_option("--check-answers", opt.check_answers,
                 "after training, answer the first N training prompts greedily and compare with their answers")
      ->check(non_negative);
  app.add_option("--min-answer-accuracy", opt.min_answer_accuracy,
                 "exit with status 3 when fewer than this fraction of --check-answers are right")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--metrics", opt.metrics, "write JSON-lines metrics to this file");
  app.add_option("--log-every", opt.log_every, "progress line and metrics record every N steps (0: none)");
  ObserveFlags observe;
  if (const int rc = parse_training_flags("finetune", app, argc, argv, opt, observe); rc >= 0) return rc;
  if (opt.lora_r == 0 && !opt.out.empty()) {
    std::fprintf(stderr, "finetune: --out writes a LoRA adapter, and --lora-r 0 trains without one; use --merged\n");
    return 2;
  }
  apply_observe_flags(observe);

  try {
    Stopwatch wall;
    auto world = dist::init_process_group();  // a world of one without a launcher
    const bool lead = world->rank() == 0;
    const Tokenizer tok = Tokenizer::load(opt.model);
    const InstructOptions io{.seq_len = opt.seq_len,
                             .chat_template = opt.chat_template == "plain" ? ChatTemplate::Plain : ChatTemplate::Llama3,
                             .layout = opt.layout == "padded" ? InstructLayout::Padded : InstructLayout::Packed};
    std::vector<ChatRecord> records = read_chat_records(opt.data);
    const auto held = static_cast<std::size_t>(std::floor(opt.eval_fraction * static_cast<double>(records.size())));
    PTRAIN_CHECK(records.size() > held, DataError, "[finetune.data] ", opt.data, " holds ", records.size(),
                 " records; with --eval-fraction ", opt.eval_fraction, " none is left to train on");
    const std::vector<ChatRecord> eval_records(records.end() - static_cast<std::ptrdiff_t>(held), records.end());
    records.resize(records.size() - held);
    InstructDataset<float> train_data(records, tok, io);
    std::unique_ptr<InstructDataset<float>> eval_data;
    if (!eval_records.empty()) eval_data = std::make_unique<InstructDataset<float>>(eval_records, tok, io);

    nn::LlamaConfig cfg = nn::LlamaConfig::from_hf_config_file(std::filesystem::path(opt.model) / "config.json");
    if (io.layout == InstructLayout::Packed) {  // packed records attend only within themselves
      PTRAIN_CHECK(tok.document_separator(), DataError, "[finetune.layout] the tokenizer has no document separator "
                   "to keep packed records apart; use --layout padded");
      cfg.document_token = *tok.document_separator();
    }
    manual_seed(opt.seed);
    auto model = std::make_shared<nn::Llama<float>>(cfg);
    const std::string loaded = ckpt::load_llama_weights(opt.model, *model);
    const nn::LoraConfig lora{.r = opt.lora_r, .alpha = opt.lora_alpha, .dropout = opt.lora_dropout,
                              .target_modules = opt.lora_targets, .dropout_seed = opt.seed};
    if (opt.lora_r > 0) nn::apply_lora(*model, lora);
    const std::int64_t all = model->num_parameters(), trainable = model->num_trainable_parameters();

    parallel::Plan<float> plan = parallel::LocalOptions{};
    if (opt.parallel == "ddp") plan = parallel::DDPOptions{};
    if (opt.parallel == "fsdp") plan = parallel::FSDPOptions{};
    auto engine = parallel::make_engine<float>(model, *world, plan);
    optim::AdamW<float> optimizer(engine->parameters(), {.lr = opt.lr, .weight_decay = opt.weight_decay});
    train::Trainer<float> trainer(
        *engine, optimizer, train_data,
        {.epochs = opt.epochs, .batch = opt.batch, .grad_accum = opt.grad_accum, .seed = opt.seed,
         .log_every = opt.log_every, .metrics = opt.metrics, .tensorboard = observe.tensorboard_dir,
         .checkpoint_dir = opt.checkpoint_dir, .checkpoint_every = opt.checkpoint_every,
         .keep_checkpoints = opt.keep_checkpoints, .resume = opt.resume, .start_over = opt.start_over,
         .preempt_exit_code = opt.preempt_exit_code,
         .config = {{"program", "finetune"}, {"model", opt.model}, {"data", opt.data}, {"seq_len", opt.seq_len},
                    {"template", opt.chat_template}, {"layout", opt.layout}, {"lora_r", opt.lora_r},
                    {"lora_alpha", opt.lora_alpha}, {"lora_targets", opt.lora_targets}, {"seed", opt.seed}}});
    const std::int64_t total = trainer.total_steps();
    trainer.schedule = optim::WarmupCosine{.base_lr = opt.lr, .warmup = std::max<std::int64_t>(1, total * 3 / 100),
                                           .total = total};
    if (eval_data)
      trainer.evaluate = [&](parallel::Engine<float>& e) {
        return nlohmann::json{{"eval_loss", eval_loss(e, *eval_data, opt.batch)}};
      };
    if (lead)
      std::printf("%s: %s; %lld of %lld parameters train (%s); %lld training rows of %lld tokens (%lld answer "
                  "tokens), %zu held-out records; %d rank(s) (%s), %s, %lld steps\n",
                  opt.model.c_str(), loaded.c_str(), static_cast<long long>(trainable), static_cast<long long>(all),
                  opt.lora_r > 0 ? ("LoRA r " + std::to_string(opt.lora_r)).c_str() : "full fine-tuning",
                  static_cast<long long>(train_data.size()), static_cast<long long>(opt.seq_len),
                  static_cast<long long>(train_data.answer_tokens()), eval_records.size(), world->size(),
                  world->backend().c_str(), opt.parallel.c_str(), static_cast<long long>(total));
    const train::TrainResult result = trainer.run();
    if (result.preempted) return result.exit_code;

    // FSDP holds shards: every rank gathers the whole parameters, rank 0 keeps them.
    if (auto* fsdp = dynamic_cast<parallel::FSDP<float>*>(engine.get())) {
      auto full = fsdp->full_parameters();
      if (lead) {
        std::map<std::string, Tensor<float>> by_name(full.begin(), full.end());
        for (auto& p : model->named_parameters()) {
          const auto it = by_name.find(p.name);
          PTRAIN_CHECK(it != by_name.end(), Error, "[finetune.fsdp] FSDP has no parameter '", p.name, "'");
          p.param->value = it->second;
        }
      }
    }
    if (!lead) return 0;
    if (!opt.out.empty())
      std::printf("adapter: %s in %s\n", ckpt::save_lora_adapter(opt.out, *model, lora, opt.model).c_str(),
                  opt.out.c_str());
    if (!opt.merged.empty()) {
      const std::string what = ckpt::save_llama_weights(opt.merged, *model);
      for (const char* f : {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"})
        if (std::filesystem::is_regular_file(std::filesystem::path(opt.model) / f))
          std::filesystem::copy_file(std::filesystem::path(opt.model) / f, std::filesystem::path(opt.merged) / f,
                                     std::filesystem::copy_options::overwrite_existing);
      std::printf("merged model: %s in %s\n", what.c_str(), opt.merged.c_str());
    }
    Generator gen(opt.seed);
    for (const std::string& s : opt.samples) {
      const auto [prompt, answer] = prompt_and_answer(tokenize_chat(tok, {{"user", s}, {"assistant", ""}}, io.chat_template));
      auto out = nn::generate(*model, prompt, opt.sample_tokens, 0.0, 0, gen);
      out.erase(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(prompt.size()));
      const auto stop = std::find(out.begin(), out.end(), answer.back());  // the template's closing token
      std::printf("--- %s\n%s\n", s.c_str(), tok.decode({out.begin(), stop}).c_str());
    }
    const auto checked = std::min<std::int64_t>(opt.check_answers, static_cast<std::int64_t>(records.size()));
    std::int64_t right = 0;
    for (std::int64_t i = 0; i < checked; ++i) {
      const auto [prompt, answer] = prompt_and_answer(tokenize_chat(tok, records[static_cast<std::size_t>(i)], io.chat_template));
      auto out = nn::generate(*model, prompt, static_cast<std::int64_t>(answer.size()), 0.0, 0, gen);
      right += std::equal(answer.begin(), answer.end(), out.begin() + static_cast<std::ptrdiff_t>(prompt.size()));
    }
    const double accuracy = checked > 0 ? static_cast<double>(right) / static_cast<double>(checked) : 1.0;
    if (checked > 0) std::printf("answers: %lld of %lld right\n", static_cast<long long>(right), static_cast<long long>(checked));
    std::printf("final eval_loss %.4f, wall time %.1f s\n",
                result.last_eval.is_object() ? result.last_eval.value("eval_loss", 0.0) : 0.0, wall.seconds());
    if (accuracy < opt.min_answer_accuracy) {
      std::fprintf(stderr, "finetune: %lld of %lld answers right, below --min-answer-accuracy %.2f\n",
                   static_cast<long long>(right), static_cast<long long>(checked), opt.min_answer_accuracy);
      return 3;
    }
    return 0;
  } catch (const Error& e) {
    dist::record_error(e);  // for the launcher's TORCHELASTIC_ERROR_FILE (torchrun, ptrun)
    std::fprintf(stderr, "finetune: %s\n", e.what());
    return 1;
  }
}
