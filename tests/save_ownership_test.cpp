// NOTE: [Nothing dtp did not write] (src/io/staged_dir.h): every save path
// starts from a folder holding the user's files and subfolders; those survive
// byte for byte, a refused save leaves no new entry, and dtp replaces or
// removes only what it wrote. Also the step-<N> layout (find_checkpoint,
// remove_old_steps) and the checksum over index.json.
#include "dist.h"
#include "files.h"
#include "llama_util.h"

#include "dtp/dcp/checkpoint.h"
#include "dtp/dcp/step_folders.h"
#include "dtp/dtensor.h"
#include "dtp/io/safetensors.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"
#include "io/staged_dir.h"

#include <nlohmann/json.hpp>
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <map>
#include <set>

using namespace dtp;
using namespace dtp::models;
using dtp::test::any_error_of;
using dtp::test::expect_error;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

namespace fs = std::filesystem;

class SaveOwnershipTest : public dtp::test::TempDirTest {
 protected:
  // Every entry under `root` (recursively) with its bytes ("" for folders).
  std::map<std::string, std::string> tree(const std::string& root) const {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(root)) {
      const std::string rel = fs::relative(e.path(), root).string();
      out[rel] = e.is_directory() ? "" : dtp::test::read_bytes(e.path().string());
    }
    return out;
  }
  // The user's folder: a file, a subfolder with a file, an empty subfolder.
  std::string userFolder(const std::string& name) const {
    const std::string d = file(name);
    fs::create_directories(d + "/runs");
    fs::create_directories(d + "/empty");
    dtp::test::write_bytes(d + "/notes.txt", "my notes\n");
    dtp::test::write_bytes(d + "/runs/r1.csv", "step,loss\n1,2.5\n");
    return d;
  }
  std::map<std::string, std::string> entries(const std::string& d) const {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::directory_iterator(d)) out[e.path().filename().string()] = "";
    return out;
  }
};

LlamaConfig config() {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  return c;
}

Llama tpLlama(uint64_t seed) {
  LlamaConfig c = config();
  c.seed = seed;
  Llama model(c);
  apply_tensor_parallel(model, init_device_mesh("cpu", {2}, {"tp"}), TensorParallelOptions{true, kSeq});
  return model;
}

// The full values of every parameter (a collective).
std::map<std::string, at::Tensor> values(Llama& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& p = item.value();
    out[item.key()] = is_dtensor(p) ? full_tensor(p.detach()) : p.detach().clone();
  }
  return out;
}

void expectEqual(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                 const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (const auto& [name, w] : want) EXPECT_TRUE(got.at(name).equal(w)) << where << ": " << name << " differs";
}

// dcp::save and save_state onto a folder of the user's: refused on every
// rank, naming the folder and its entries; nothing changes, nothing is added.
TEST_F(SaveOwnershipTest, SaveOntoAFolderOfTheUsersIsRefusedAndChangesNothing) {
  const std::string exp = userFolder("exp");
  const auto before = tree(file(""));
  run_ranks(2, [&](int) {
    Llama model = tpLlama(1);
    expect_error([&] { dcp::save_state(exp, *model, nullptr, {}, llama_state_dict_options()); },
                 {"save of '" + exp + "' failed", "holds entries dtp did not write: 'empty', 'notes.txt', 'runs'",
                  "never deletes what it did not write", "step-N"});
  });
  EXPECT_EQ(tree(file("")), before) << "a refused save changed or added entries";
}

// An earlier checkpoint of dtp's is replaced, and files of the old one that
// the new one does not write (a larger world's rank files) go; an empty
// folder is taken; the user's files beside the checkpoint stay.
TEST_F(SaveOwnershipTest, ReplacesOnlyItsOwnCheckpointOrAnEmptyFolder) {
  const std::string exp = userFolder("exp"), ck = exp + "/ck";
  fs::create_directories(ck);
  const auto user = tree(exp);
  run_ranks(2, [&](int) {
    Llama model = tpLlama(1);
    dcp::save_state(ck, *model, nullptr, {{"v", "1"}}, llama_state_dict_options());
  });
  EXPECT_TRUE(fs::exists(ck + "/rank-00001.safetensors"));
  std::map<std::string, at::Tensor> want;
  {
    Llama model(config());  // one process: rank 0 writes everything
    dcp::save_state(ck, *model, nullptr, {{"v", "2"}}, llama_state_dict_options());
    want = values(model);
  }
  EXPECT_EQ(entries(ck), (std::map<std::string, std::string>{{"index.json", ""}, {"rank-00000.safetensors", ""}}));
  EXPECT_FALSE(fs::exists(ck + ".incomplete"));
  Llama back(config());
  EXPECT_EQ(dcp::load_state(ck, *back, nullptr, llama_state_dict_options()).at("v"), "2");
  expectEqual(values(back), want, "the replacing checkpoint");
  for (const auto& [name, bytes] : user) {
    if (name.rfind("ck", 0) != 0) EXPECT_EQ(tree(exp).at(name), bytes) << name;
  }
  // A checkpoint folder the user added a file to is theirs now.
  dtp::test::write_bytes(ck + "/README", "about this run\n");
  expect_error([&] { dcp::save_state(ck, *back, nullptr, {}, llama_state_dict_options()); },
               {"holds entries dtp did not write: 'README'"});
  EXPECT_EQ(dtp::test::read_bytes(ck + "/README"), "about this run\n");
  // An index.json of another writer is not dtp's either.
  const std::string other = file("other");
  fs::create_directories(other);
  dtp::test::write_bytes(other + "/index.json", "{\"pages\": 3}");
  expect_error([&] { dcp::save_state(other, *back, nullptr, {}, llama_state_dict_options()); },
               {"'" + other + "/index.json' is not the index of a dtp checkpoint"});
  EXPECT_EQ(dtp::test::read_bytes(other + "/index.json"), "{\"pages\": 3}");
}

// "<dir>.incomplete": a stale one of dtp's (a killed save: marker, a rank
// file, a temporary file) is cleared; one holding the user's files is
// refused by name; one that a live save holds (its marker locked) is
// refused as "another save is writing".
TEST_F(SaveOwnershipTest, StagingFolderIsClearedOnlyWhenItIsDtpsAndFree) {
  const std::string ck = file("ck"), stale = ck + ".incomplete";
  Llama model(config());
  fs::create_directories(stale);
  dtp::test::write_bytes(stale + "/.dtp-writing", "pid 1 on elsewhere\n");
  dtp::test::write_bytes(stale + "/rank-00000.safetensors", "half");
  dtp::test::write_bytes(stale + "/rank-00001.safetensors.tmp.4242", "half");
  dcp::save_state(ck, *model, nullptr, {}, llama_state_dict_options());
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(ck + "/index.json"));

  fs::create_directories(stale);
  dtp::test::write_bytes(stale + "/mine.txt", "keep me");
  const auto before = tree(file(""));
  expect_error([&] { dcp::save_state(ck, *model, nullptr, {}, llama_state_dict_options()); },
               {"'" + stale + "' holds entries dtp did not write: 'mine.txt'"});
  EXPECT_EQ(tree(file("")), before);
  fs::remove_all(stale);

  {
    io::StagedDir live(ck, [](const std::string&) { return false; }, io::StagedDir::Mode::kMerge, "test");
    expect_error([&] { dcp::save_state(ck, *model, nullptr, {}, llama_state_dict_options()); },
                 {"another save is writing '" + ck + "'", "pid " + std::to_string(::getpid()), "AsyncSaver::wait()"});
  }
  EXPECT_FALSE(fs::exists(stale)) << "the live save's staging folder outlived it";
  dcp::save_state(ck, *model, nullptr, {}, llama_state_dict_options());
}

// A save that fails writing (a file size limit stands in for a full disk)
// leaves the previous checkpoint, the user's files beside it, and no staging
// folder behind.
TEST_F(SaveOwnershipTest, FailedSaveRemovesItsStagingAndKeepsTheUsersFiles) {
  const std::string exp = userFolder("exp"), ck = exp + "/step-1";
  run_ranks(2, [&](int) {
    Llama model = tpLlama(1);
    dcp::save_state(ck, *model, nullptr, {{"step", "1"}}, llama_state_dict_options());
  });
  const auto before = tree(exp);
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto previous = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit tiny = old;
  tiny.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &tiny), 0);
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank) {
    Llama model = tpLlama(2);
    errors[rank] = any_error_of([&] { dcp::save_state(ck, *model, nullptr, {{"step", "2"}}, llama_state_dict_options()); });
  });
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  for (const auto& e : errors) EXPECT_NE(e.find("File too large"), std::string::npos) << e;
  EXPECT_EQ(tree(exp), before) << "the failed save changed the folder or left entries";
}

// An async save onto the user's folder fails in the background (thrown by
// wait()) and changes nothing; into a step folder beside the user's files it
// writes only that folder.
TEST_F(SaveOwnershipTest, AsyncSaveKeepsTheUsersFiles) {
  const std::string exp = userFolder("exp");
  const auto before = tree(exp);
  run_ranks(2, [&](int) {
    Llama model = tpLlama(1);
    dcp::AsyncSaver saver;
    saver.save(dcp::get_model_state_dict(*model, llama_state_dict_options()), exp);
    expect_error([&] { saver.wait(); }, {"holds entries dtp did not write"});
    saver.save(dcp::get_model_state_dict(*model, llama_state_dict_options()), dcp::step_folder(exp, 3));
    saver.wait();
  });
  auto after = tree(exp);
  for (const auto& [name, bytes] : before) EXPECT_EQ(after.at(name), bytes) << name;
  std::set<std::string> added;
  for (const auto& [name, bytes] : after) {
    if (!before.count(name)) added.insert(name);
  }
  EXPECT_EQ(added, (std::set<std::string>{"step-3", "step-3/index.json", "step-3/rank-00000.safetensors",
                                          "step-3/rank-00001.safetensors"}));
}

// dcp::save to a folder an AsyncSaver is still writing: the save that
// stages second is refused by name while the other holds the folder, or
// they run one after the other; never a mix (the folder then loads, checksums verified, and holds one of
// the two snapshots whole).
TEST_F(SaveOwnershipTest, SaveWhileAnAsyncSaveWritesTheFolderIsRefusedOrSerial) {
  const std::string ck = file("ck");
  int refused = 0;
  for (int round = 0; round < 3; ++round) {
    dcp::StateDict a, b;
    a.add("w", at::full({4 << 20}, 1.0, at::kFloat));  // 16 MiB: the background write takes a while
    b.add("w", at::full({4 << 20}, 2.0, at::kFloat));
    dcp::AsyncSaver saver;
    saver.save(a, ck);
    // Whichever stages second is refused (the background thread may start
    // after the synchronous save did), or both run one after the other.
    const std::string sync_error = any_error_of([&] { dcp::save(b, ck); });
    const std::string async_error = any_error_of([&] { saver.wait(); });
    for (const auto& error : {sync_error, async_error}) {
      if (error == "<no error>") continue;
      EXPECT_NE(error.find("another save is writing '" + ck + "'"), std::string::npos) << error;
      ++refused;
    }
    EXPECT_TRUE(sync_error == "<no error>" || async_error == "<no error>") << "both saves were refused";
    dcp::StateDict back;
    back.add("w", at::zeros({4 << 20}, at::kFloat));
    dcp::load(back, ck);
    const double v = back.tensors[0].second[0].item<double>();
    EXPECT_TRUE(back.tensors[0].second.equal(at::full({4 << 20}, v, at::kFloat)) && (v == 1.0 || v == 2.0))
        << "the folder mixes the two saves";
    EXPECT_FALSE(fs::exists(ck + ".incomplete"));
  }
  std::printf("one of two concurrent saves refused in %d of 3 rounds\n", refused);
}

// Ranks that pass different folders are told so before anything is written.
TEST_F(SaveOwnershipTest, RanksThatPassDifferentFoldersAreNamed) {
  run_ranks(2, [&](int rank) {
    Llama model = tpLlama(1);
    const std::string mine = file("ck" + std::to_string(rank));
    expect_error([&] { dcp::save_state(mine, *model, nullptr, {}, llama_state_dict_options()); },
                 {"dcp::save: the ranks passed different folders", "rank 0: '" + file("ck0") + "'",
                  "rank 1: '" + file("ck1") + "'"});
  });
  EXPECT_FALSE(fs::exists(file("ck0")) || fs::exists(file("ck1")) || fs::exists(file("ck0.incomplete")));
}

// save_hf into a folder holding the user's README, tokenizer and files, and
// a sharded export of its own: the export's files come in, its own older
// shards that the new export does not reuse go, everything else stays. The
// folder the model was loaded from takes an export too.
TEST_F(SaveOwnershipTest, HuggingFaceExportKeepsEverythingButItsOwnStaleShards) {
  const std::string hf = userFolder("hf");
  dtp::test::write_bytes(hf + "/README.md", "# my model\n");
  dtp::test::write_bytes(hf + "/tokenizer.json", "{\"mine\": true}");
  dtp::test::write_bytes(hf + "/pytorch_model.bin", "not dtp's");
  std::map<std::string, at::Tensor> want;
  run_ranks(2, [&](int rank) {
    Llama model = tpLlama(3);
    HFSaveOptions o;
    o.max_shard_bytes = 4096;  // several shards
    save_hf(model, hf, o);
    o.max_shard_bytes = uint64_t{1} << 30;  // one file: the shards and their index are stale
    save_hf(model, hf, o);
    auto v = values(model);
    if (rank == 0) want = v;
  });
  const auto e = entries(hf);
  EXPECT_EQ(e, (std::map<std::string, std::string>{{"README.md", ""}, {"config.json", ""}, {"empty", ""},
                                                   {"model.safetensors", ""}, {"notes.txt", ""},
                                                   {"pytorch_model.bin", ""}, {"runs", ""}, {"tokenizer.json", ""}}));
  EXPECT_EQ(dtp::test::read_bytes(hf + "/README.md"), "# my model\n");
  EXPECT_EQ(dtp::test::read_bytes(hf + "/tokenizer.json"), "{\"mine\": true}");
  EXPECT_EQ(dtp::test::read_bytes(hf + "/runs/r1.csv"), "step,loss\n1,2.5\n");
  EXPECT_FALSE(fs::exists(hf + ".incomplete"));
  // Loaded from the folder, exported into it again, loaded again: equal.
  run_ranks(2, [&](int) {
    LlamaConfig c = llama_config_from_hf(hf, 32);
    c.dtype = at::kDouble;
    Llama model(c);
    apply_tensor_parallel(model, init_device_mesh("cpu", {2}, {"tp"}), TensorParallelOptions{true, kSeq});
    load_hf_weights(model, hf);
    HFSaveOptions o;
    o.source_dir = hf;
    save_hf(model, hf, o);
    Llama again(c);
    load_hf_weights(again, hf);
    expectEqual(values(again), want, "after exporting into the folder it was loaded from");
  });
  EXPECT_EQ(dtp::test::read_bytes(hf + "/notes.txt"), "my notes\n");
  // A folder where the export writes a file is refused by name; a path that
  // is a file is refused before anything is written.
  dtp::test::write_bytes(file("a-file"), "x");
  Llama model(config());
  expect_error([&] { save_hf(model, file("a-file")); }, {"'" + file("a-file") + "' exists and is not a folder"});
  EXPECT_EQ(dtp::test::read_bytes(file("a-file")), "x");
  EXPECT_FALSE(fs::exists(file("a-file.incomplete")));
}

// save_safetensors replaces a file only when dtp wrote it (its checksums):
// another writer's file, one saved without checksums, and a folder are
// refused and left as they were, with no temporary file behind.
TEST_F(SaveOwnershipTest, SingleFileWriterReplacesOnlyItsOwnFiles) {
  const std::string mine = file("mine.safetensors"), theirs = file("theirs.safetensors");
  io::save_safetensors(mine, {{"w", at::zeros({3})}});
  io::save_safetensors(mine, {{"w", at::ones({3})}});
  EXPECT_TRUE(io::load_safetensors(mine).tensors[0].second.equal(at::ones({3})));
  io::save_safetensors(theirs, {{"w", at::zeros({3})}}, {}, /*checksums=*/false);
  const std::string bytes = dtp::test::read_bytes(theirs);
  expect_error([&] { io::save_safetensors(theirs, {{"w", at::ones({3})}}); },
               {"'" + theirs + "' exists and was not written by dtp", "remove the file yourself"});
  EXPECT_EQ(dtp::test::read_bytes(theirs), bytes);
  dtp::test::write_bytes(file("notes.txt"), "text");
  expect_error([&] { io::save_safetensors(file("notes.txt"), {{"w", at::ones({3})}}); }, {"was not written by dtp"});
  EXPECT_EQ(dtp::test::read_bytes(file("notes.txt")), "text");
  fs::create_directories(file("folder"));
  expect_error([&] { io::save_safetensors(file("folder"), {{"w", at::ones({3})}}); }, {"exists and is not a file"});
  EXPECT_EQ(entries(dir_.string()), (std::map<std::string, std::string>{{"folder", ""}, {"mine.safetensors", ""},
                                                                        {"notes.txt", ""}, {"theirs.safetensors", ""}}));
}

// torchtitan's layout: find_checkpoint takes the newest complete step and
// names what it skipped; remove_old_steps removes only dtp's own older step
// folders, entry by entry.
TEST_F(SaveOwnershipTest, StepFoldersResolveToTheNewestCompleteAndPruneOnlyTheirOwn) {
  const std::string exp = userFolder("exp");
  Llama model(config());
  for (int64_t step : {2, 4, 6}) {
    dcp::save_state(dcp::step_folder(exp, step), *model, nullptr, {{"step", std::to_string(step)}},
                    llama_state_dict_options());
  }
  EXPECT_EQ(dcp::step_folder(exp + "/", 6), exp + "/step-6");
  // A killed save of step 8, and a step 7 whose index was damaged.
  fs::copy(exp + "/step-6", exp + "/step-8.incomplete");
  fs::copy(exp + "/step-6", exp + "/step-7");
  {
    std::string index = dtp::test::read_bytes(exp + "/step-7/index.json");
    index[index.find("\"step\"") + 1] = 'S';  // a metadata key renamed by a flipped byte
    dtp::test::write_bytes(exp + "/step-7/index.json", index);
  }
  const auto found = dcp::find_checkpoint(exp);
  EXPECT_EQ(found.path, exp + "/step-6");
  ASSERT_EQ(found.skipped.size(), 2u);
  EXPECT_NE(found.skipped[0].find("step-8.incomplete': a save that did not finish"), std::string::npos) << found.skipped[0];
  EXPECT_NE(found.skipped[1].find("step-7': load_checkpoint: '" + exp + "/step-7/index.json' fails its checksum"),
            std::string::npos) << found.skipped[1];
  EXPECT_EQ(dcp::find_checkpoint(exp + "/step-4").path, exp + "/step-4");
  expect_error([&] { dcp::find_checkpoint(exp + "/runs"); }, {"holds no complete checkpoint", "dtp-train --save"});
  // step-4 carries the user's file: dtp's entries go, the folder and the file stay.
  dtp::test::write_bytes(exp + "/step-4/eval.txt", "0.91");
  // A killed save of step 3 (older than step 6): dtp's and free, so it goes;
  // step-8.incomplete, newer than any complete step, stays.
  fs::create_directories(exp + "/step-3.incomplete");
  dtp::test::write_bytes(exp + "/step-3.incomplete/.dtp-writing", "pid 1 on elsewhere\n");
  fs::copy(exp + "/step-2/rank-00000.safetensors", exp + "/step-3.incomplete/rank-00000.safetensors");
  const auto removed = dcp::remove_old_steps(exp, 1);
  EXPECT_EQ(removed, (std::vector<std::string>{exp + "/step-3.incomplete", exp + "/step-2"}));
  EXPECT_EQ(entries(exp + "/step-4"), (std::map<std::string, std::string>{{"eval.txt", ""}}));
  EXPECT_EQ(entries(exp), (std::map<std::string, std::string>{{"empty", ""}, {"notes.txt", ""}, {"runs", ""},
                                                              {"step-4", ""}, {"step-6", ""}, {"step-7", ""},
                                                              {"step-8.incomplete", ""}}));
  EXPECT_EQ(dtp::test::read_bytes(exp + "/runs/r1.csv"), "step,loss\n1,2.5\n");
}

// The index is protected by a checksum over its content: the one corruption
// a 102-copy fuzz missed (a flipped byte renaming "optimizer.param_groups")
// is an error before anything changes; an index of the older format (no
// checksum) still loads, and one missing the optimizer's groups is refused.
TEST_F(SaveOwnershipTest, IndexChangesAreDetectedAndMissingOptimizerGroupsRefused) {
  const std::string ck = file("ck");
  Llama model(config());
  auto opt = std::make_unique<dtp::optim::AdamW>(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  dtp::test::train_llama(model, *opt, 0, 1);
  dcp::save_state(ck, *model, opt.get(), {}, llama_state_dict_options());
  const std::string index = dtp::test::read_bytes(ck + "/index.json");
  const size_t key = index.find("optimizer.param_groups");
  ASSERT_NE(key, std::string::npos);
  std::string flipped = index;
  flipped[key + 10] ^= 0x01;
  dtp::test::write_bytes(ck + "/index.json", flipped);
  expect_error([&] { dcp::load_state(ck, *model, opt.get(), llama_state_dict_options()); },
               {"index.json' fails its checksum", "load the previous checkpoint"});
  // The older format: no checksum. It loads; without the groups it is refused.
  auto v1 = nlohmann::json::parse(index);
  v1.erase("checksum");
  v1["format"] = "dtp-checkpoint-1";
  dtp::test::write_bytes(ck + "/index.json", v1.dump(1));
  dcp::load_state(ck, *model, opt.get(), llama_state_dict_options());
  v1["metadata"].erase("optimizer.param_groups");
  dtp::test::write_bytes(ck + "/index.json", v1.dump(1));
  expect_error([&] { dcp::load_state(ck, *model, opt.get(), llama_state_dict_options()); },
               {"no \"optimizer.param_groups\" metadata", "corrupt"});
}

}  // namespace
