// dtp-serve: OpenAI's HTTP API over a model run with tensor parallelism.
//   dtprun -n 2 dtp-serve --hf Qwen2.5-0.5B-Instruct --port 8000
//   curl http://127.0.0.1:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'
// Rank 0 serves HTTP (127.0.0.1 unless --host says otherwise) and leads the
// engine (dtp/inference/engine.h): it plans each step and every rank runs it
// (NOTE: [Serving step] in src/inference/model_runner.h) on a paged KV
// cache (--block-size, --kv-cache-mib per rank), prefilling long prompts in
// --prefill-chunk pieces. SIGINT or SIGTERM: queued requests get 503,
// running ones finish (up to --shutdown-grace-s), then every rank exits 0.
// A rank that dies: open requests get 503 naming it, then a non-zero exit
// (NOTE: [A dead rank] in rank_watch.h).
#include "../common/checkpoint_flags.h"
#include "../common/inference_setup.h"
#include "../common/model_flags.h"
#include "../common/parallel_flags.h"
#include "chat_page.h"
#include "http_stop.h"
#include "openai_api.h"
#include "rank_watch.h"

#include "dtp/dcp/checkpoint.h"
#include "dtp/dtensor.h"
#include "dtp/inference/engine.h"
#include "dtp/models/checkpoint.h"
#include "dtp/models/engine_model.h"
#include "dtp/models/generate.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
#include "dtp/text/chat.h"
#include "dtp/text/hf_tokenizer.h"
#include "dtp/text/tokenizer.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <thread>

namespace {

std::atomic<bool> gStop{false};

void onSignal(int) { gStop = true; }

}  // namespace

int main(int argc, char** argv) {
  using namespace dtp;
  using namespace dtp::models;
  apps::ModelFlags model_flags;
  std::string checkpoint, hf, tokenizer_path, device = "cpu", host = "127.0.0.1", served_model_name;
  int port = 8000;
  int64_t context = 0, http_threads = 64;
  apps::InferenceParallelFlags layout;
  inference::EngineOptions eo;
  double grace_s = 2.0;
  CLI::App app{"dtp-serve: OpenAI's HTTP API (/v1/completions, /v1/chat/completions, /v1/models) over a model run "
               "with tensor parallelism on every rank of dtprun"};
  auto* ck = app.add_option("--checkpoint", checkpoint, "Folder written by dtp-train --save (its newest step-<N>/)");
  app.add_option("--hf", hf, "Hugging Face folder (config.json, safetensors, tokenizer.json or tokenizer.model)")->excludes(ck);
  app.add_option("--tokenizer", tokenizer_path, "A model folder, tokenizer.json, tokenizer.model or \"byte\" [default: "
                 "the --hf folder's, else byte]");
  apps::add_model_flags(app, model_flags, /*inference=*/true);
  apps::add_inference_parallel_flags(app, layout);
  app.add_option("--host", host, "Address to listen on")->capture_default_str();
  app.add_option("--port", port, "Port (0: any free one; the log line 'dtp-serve: listening on' names it)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--served-model-name", served_model_name, "The model's name in the API [default: the folder's name]");
  app.add_option("--context", context, "Cached positions per sequence (prompt + output) [default: the model's "
                 "max_seq_len]")->check(apps::kPositive);
  app.add_option("--max-batch", eo.max_batch, "Sequences decoded together")->check(apps::kPositive)->capture_default_str();
  app.add_option("--max-prefill", eo.max_prefill, "Prompts prefilled together in a step")->check(apps::kPositive)
      ->capture_default_str();
  app.add_option("--prefill-chunk", eo.prefill_chunk, "Prompt tokens prefilled per step (all prompts together): a "
                 "longer prompt is prefilled over several steps, between the others' decode steps")
      ->check(apps::kPositive)->capture_default_str();
  app.add_option("--block-size", eo.block_size, "Tokens per block of the paged KV cache")->check(apps::kPositive)
      ->capture_default_str();
  app.add_option("--kv-cache-mib", eo.kv_cache_mib, "The paged KV cache per rank, in MiB (this rank's KV heads) "
                 "[default: room for --max-batch sequences of --context tokens]")->check(apps::kPositive);
  app.add_option("--kv-cache-blocks", eo.kv_cache_blocks, "The paged KV cache in blocks (instead of --kv-cache-mib)")
      ->check(apps::kPositive)->excludes("--kv-cache-mib");
  bool two_forwards = false;
  app.add_flag("--two-forwards-per-step", two_forwards, "Run decode rows and prefill chunks as two forwards per step, "
               "as dtp-serve did before one packed forward (for measuring the difference; the same tokens)");
  app.add_flag("--enable-prefix-caching", eo.prefix_caching, "Keep full KV blocks of finished prompts and reuse them "
               "for later requests with the same prefix (vLLM's automatic prefix caching; /metrics counts "
               "dtp_serve_prefix_cache_queries_total and _hits_total)");
  app.add_option("--max-queue", eo.max_queue, "Waiting requests before 429")->check(apps::kPositive)->capture_default_str();
  app.add_option("--http-threads", http_threads, "HTTP worker threads (each open request holds one)")
      ->check(apps::kPositive)->capture_default_str();
  app.add_option("--shutdown-grace-s", grace_s, "On SIGTERM, how long running requests may go on")
      ->check(apps::kNonNegative)->capture_default_str();
  app.add_option("--device", device, "cpu, or cuda: each rank on GPU LOCAL_RANK (untested on a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  struct sigaction sa = {};
  sa.sa_handler = onSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not a dead server
  int rank = 0;
  try {
    layout.check();  // before the model: a wrong layout fails fast
    TORCH_CHECK(!checkpoint.empty() || !hf.empty(), "dtp-serve: no model: got neither --hf nor --checkpoint, expected "
                "one. Pass --hf DIR or --checkpoint DIR.");
    ProcessGroup world = init_process_group();
    rank = world.rank();
    apps::InferenceSetup setup = apps::resolve_inference(app, model_flags, checkpoint, hf, tokenizer_path, context,
                                                         rank == 0);
    LlamaConfig& config = setup.config;
    checkpoint = setup.checkpoint;
    const auto& tokenizer = setup.tokenizer;
    const std::string& folder = setup.tokenizer_folder;
    serve::ServedModel served;
    served.stop_tokens = setup.stop_tokens;
    served.chat_stop_tokens = served.stop_tokens;
    const auto* hf_tokenizer = dynamic_cast<const HfTokenizer*>(tokenizer.get());
    if (hf_tokenizer && std::filesystem::exists(folder + "/tokenizer_config.json")) {
      try {
        served.chat = ChatTemplate::from_folder(folder);
      } catch (const c10::Error& e) {
        if (rank == 0) std::cerr << "dtp-serve: no chat (/v1/chat/completions answers 400): " << e.what_without_backtrace() << "\n";
      }
      if (served.chat) {
        const auto end = hf_tokenizer->token_to_id(served.chat->end_of_turn());
        if (end && std::find(served.chat_stop_tokens.begin(), served.chat_stop_tokens.end(), *end) ==
                       served.chat_stop_tokens.end()) {
          served.chat_stop_tokens.push_back(*end);
        }
      }
    }
    Llama model =
        apps::load_inference_model(setup, hf, device, world.size(), layout, apps::weight_only_of(model_flags));
    std::cerr << "dtp-serve: " << apps::memory_after_load(world.rank()) << std::endl;
    const int64_t ctx = context > 0 ? context : config.max_seq_len;
    eo.context = ctx;
    eo.one_forward_per_step = !two_forwards;
    inference::Engine engine(engine_model(model), eo, world, tokenizer.get());
    const serve::RankPids pids = serve::gather_rank_pids(world);
    if (rank != 0) return engine.follow();

    served.name = !served_model_name.empty() ? served_model_name
                  : !hf.empty() ? std::filesystem::path(hf).lexically_normal().filename().string()
                                : std::filesystem::path(checkpoint).lexically_normal().filename().string();
    if (served.name.empty()) served.name = "dtp";
    served.tokenizer = tokenizer.get();
    served.vocab_size = config.vocab_size;
    served.context = ctx;
    served.created = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
    httplib::Server server;
    server.new_task_queue = [n = http_threads] { return new httplib::ThreadPool(static_cast<size_t>(n)); };
    serve::add_openai_routes(server, engine, served);
    serve::register_chat_page(server);
    const int bound = port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port) ? port : -1);
    TORCH_CHECK(bound > 0, "dtp-serve: --host ", host, " --port ", port, ": got a failed bind, expected a free "
                "address. Pick another --port (0: any free one).");
    std::thread http([&] { server.listen_after_bind(); });
    std::cout << "dtp-serve: listening on http://" << host << ":" << bound << " (model " << served.name << ", "
              << apps::layout_name(world.size(), layout) << ", context " << ctx << ", max batch " << eo.max_batch << ", KV cache "
              << engine.num_blocks() << " blocks of " << eo.block_size << " tokens, "
              << (engine.local_blocks() * engine.block_bytes() + (1 << 20) - 1) / (1 << 20)
              << " MiB per rank, prefill chunk " << eo.prefill_chunk << (eo.prefix_caching ? ", prefix caching" : "") << ", tokenizer "
              << tokenizer->name() << (served.chat ? std::string(", chat ") + served.chat->family_name() : "")
              << ")" << std::endl;
    // See NOTE: [A dead rank] in rank_watch.h.
    std::atomic<bool> serving{true};
    std::thread watch([&] {
      while (serving && world.size() > 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const std::string who = serve::gone_rank(pids);
        if (who.empty() || !serving) continue;  // a rank that exits after the shutdown plan is no death
        const std::string why = "dtp-serve: " + who + " exited, so the server stops (every rank runs every step). "
                                "See that rank's output for why, then restart dtp-serve.";
        std::cerr << why << std::endl;
        engine.fail_all(why);
        return;
      }
    });
    const int status = engine.serve(gStop, grace_s);
    serving = false;
    watch.join();
    // The failed requests' handlers write their 503s before the server closes.
    if (status != 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    serve::stop_http(server, bound);  // idle keep-alive clients too: NOTE: [Open connections at shutdown]
    http.join();
    std::cout << "dtp-serve: " << (status == 0 ? "stopped" : "failed") << std::endl;
    return status;
  } catch (const c10::Error& e) {
    std::cerr << "dtp-serve: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "dtp-serve: " << e.what() << "\n";
    return 1;
  }
}
