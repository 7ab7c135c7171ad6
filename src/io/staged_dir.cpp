// See NOTE: [Nothing dtp did not write] in io/staged_dir.h.
#include "io/staged_dir.h"

#include "io/file_util.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <set>

namespace dtp::io {

namespace fs = std::filesystem;

namespace {

constexpr const char* kMarker = ".dtp-writing";

// "ck/" and "ck" name the same folder.
std::string trimmed(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

// save_safetensors' temporary file: "<name>.tmp.<pid>".
bool isTempName(const std::string& name) {
  const size_t at = name.rfind(".tmp.");
  return at != std::string::npos && at + 5 < name.size() &&
         std::all_of(name.begin() + static_cast<std::ptrdiff_t>(at) + 5, name.end(), ::isdigit);
}

std::vector<std::string> entriesOf(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    out.push_back(it->path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A writer's own entries are plain files (or links) it names, and the
// marker; a folder never is.
bool isOwnEntry(const std::string& dir, const std::string& name, Owns owns, bool staging) {
  std::error_code ec;
  if (fs::symlink_status(fs::path(dir) / name, ec).type() == fs::file_type::directory) return false;
  return owns(name) || name == kMarker || (staging && isTempName(name));
}

// "'a', 'b' and 3 more": the first five names.
std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 5; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > 5) out += " and " + std::to_string(names.size() - 5) + " more";
  return out;
}

// Unlinks the entries of `dir` that are ours, then the folder when that left
// it empty. Returns the entries left (not ours).
std::vector<std::string> removeOwn(const std::string& dir, Owns owns, bool staging) {
  std::vector<std::string> left;
  for (const auto& name : entriesOf(dir)) {
    const std::string path = dir + "/" + name;
    if (!isOwnEntry(dir, name, owns, staging) || ::unlink(path.c_str()) != 0) left.push_back(name);
  }
  if (left.empty()) ::rmdir(dir.c_str());
  return left;
}

// What clearing a staging folder found: a live save holding it (`holder`,
// from its marker), or entries that are not ours (`left`); both empty when
// the folder was stale and is gone.
struct Stale {
  std::string holder;
  std::vector<std::string> left;
};

Stale clearStale(const std::string& staging, Owns owns) {
  Stale out;
  const std::string marker = staging + "/" + kMarker;
  const int fd = ::open(marker.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    std::getline(std::ifstream(marker), out.holder);
    if (out.holder.empty()) out.holder = "marker held";
    ::close(fd);
    return out;
  }
  for (const auto& name : entriesOf(staging)) {
    if (!isOwnEntry(staging, name, owns, /*staging=*/true)) out.left.push_back(name);
  }
  if (out.left.empty()) out.left = removeOwn(staging, owns, /*staging=*/true);
  if (fd >= 0) ::close(fd);
  return out;
}

std::string hostName() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace

std::string incomplete_dir(const std::string& dir) { return trimmed(dir) + ".incomplete"; }

std::vector<std::string> foreign_entries(const std::string& dir, Owns owns) {
  std::vector<std::string> out;
  for (const auto& name : entriesOf(dir)) {
    if (!isOwnEntry(dir, name, owns, /*staging=*/false)) out.push_back(name);
  }
  return out;
}

std::vector<std::string> remove_owned(const std::string& dir, Owns owns) {
  return removeOwn(dir, owns, /*staging=*/false);
}

bool remove_stale_staging(const std::string& staging, Owns owns) {
  const Stale stale = clearStale(staging, owns);
  return stale.holder.empty() && stale.left.empty();
}

StagedDir::StagedDir(std::string dir, Owns owns, Mode mode, std::string api)
    : dir_(trimmed(std::move(dir))), staging_(dir_ + ".incomplete"), api_(std::move(api)), owns_(owns), mode_(mode) {
  std::error_code ec;
  if (fs::exists(dir_, ec)) {
    TORCH_CHECK(fs::is_directory(dir_, ec), api_, ": '", dir_, "' exists and is not a folder (an old single-file "
                "checkpoint?). dtp never replaces it; save to another path, or move it away.");
    if (mode_ == Mode::kReplace) {
      TORCH_CHECK(!fs::is_symlink(dir_, ec), api_, ": '", dir_, "' is a symbolic link, which a save would replace. "
                  "Save to the folder it points to.");
      const auto all = foreign_entries(dir_, owns_);
      TORCH_CHECK(all.empty(), api_, ": '", dir_, "' holds entries dtp did not write: ",
                  listed(all),
                  ". dtp replaces only an empty folder or an earlier checkpoint of its own, and never deletes what it "
                  "did not write. Save to a new folder (dtp-train --save DIR writes DIR/step-N/ inside it), or move "
                  "those entries away.");
    }
  }
  // A stale incomplete folder: ours when its entries are, and free when no
  // live save holds its marker.
  if (fs::exists(fs::symlink_status(staging_, ec))) {
    TORCH_CHECK(fs::symlink_status(staging_, ec).type() == fs::file_type::directory, api_, ": '", staging_,
                "' exists and is not a folder, so dtp cannot write there. Move it away.");
    const Stale stale = clearStale(staging_, owns_);
    TORCH_CHECK(stale.holder.empty(), api_, ": another save is writing '", dir_, "' (", stale.holder,
                "; its files are in '", staging_, "'). Wait for it to finish (AsyncSaver::wait()), or save to "
                "another folder.");
    TORCH_CHECK(stale.left.empty(), api_, ": '", staging_, "' holds entries dtp did not write: ", listed(stale.left),
                ". It is where dtp stages this save; move those entries away, or save to another folder.");
  }
  const fs::path parent = fs::absolute(staging_).parent_path();
  fs::create_directories(parent, ec);
  TORCH_CHECK(!ec, api_, ": cannot create '", parent.string(), "' (", ec.message(), "). Check the path and permissions.");
  // Made under a name of its own with its marker locked, then renamed into
  // place without replacing: no other save ever sees a live staging folder
  // without its locked marker (and mistakes it for a stale one).
  static std::atomic<int64_t> made{0};
  const std::string fresh = c10::str(staging_, ".", ::getpid(), ".", made++);
  TORCH_CHECK(::mkdir(fresh.c_str(), 0755) == 0, api_, ": cannot create '", fresh, "': ", errno_text(),
              ". Check the path and permissions.");
  lock_fd_ = ::open((fresh + "/" + kMarker).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (lock_fd_ < 0 || ::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const std::string err = errno_text();
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
    removeOwn(fresh, owns_, /*staging=*/true);
    TORCH_CHECK(false, api_, ": cannot create and lock '", fresh, "/", kMarker, "': ", err, ". dtp needs flock(2) "
                "on the checkpoint's filesystem to keep two saves apart; save to another filesystem.");
  }
  const std::string holder = "pid " + std::to_string(::getpid()) + " on " + hostName() + "\n";
  write_all(lock_fd_, holder.data(), holder.size());
  int placed = ::renameat2(AT_FDCWD, fresh.c_str(), AT_FDCWD, staging_.c_str(), RENAME_NOREPLACE);
  if (placed != 0 && (errno == EINVAL || errno == ENOSYS) && !fs::exists(staging_, ec)) {
    placed = ::rename(fresh.c_str(), staging_.c_str());  // no RENAME_NOREPLACE here (NFS): a small window
  }
  if (placed != 0) {
    const int err = errno;
    removeOwn(fresh, owns_, /*staging=*/true);
    ::close(lock_fd_);
    lock_fd_ = -1;
    TORCH_CHECK(err != EEXIST && err != ENOTEMPTY, api_, ": another save is writing '", dir_, "' (it created '",
                staging_, "' just now). Wait for it to finish (AsyncSaver::wait()), or save to another folder.");
    TORCH_CHECK(false, api_, ": renaming '", fresh, "' to '", staging_, "' failed: ",
                std::error_code(err, std::generic_category()).message(), ".");
  }
}

StagedDir::~StagedDir() {
  if (!committed_) removeOwn(staging_, owns_, /*staging=*/true);
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

void StagedDir::commit(Owns stale) {
  fsync_dir(staging_);
  // The marker stays (locked) until the files are in place, so no other save
  // takes the staging folder for a stale one; then it goes (the lock stays
  // held on the unlinked file until the destructor).
  std::error_code ec;
  if (!fs::exists(dir_, ec)) {
    TORCH_CHECK(::rename(staging_.c_str(), dir_.c_str()) == 0, api_, ": renaming '", staging_, "' to '", dir_,
                "' failed: ", errno_text(), ".");
    committed_ = true;
    ::unlink((dir_ + "/" + kMarker).c_str());
    fsync_parent(dir_);
    return;
  }
  if (mode_ == Mode::kMerge) {
    auto staged = entriesOf(staging_);
    staged.erase(std::remove(staged.begin(), staged.end(), kMarker), staged.end());
    for (const auto& name : staged) {
      TORCH_INTERNAL_ASSERT(owns_(name), "staged '", name, "' is not a name this writer owns");
      TORCH_CHECK(!fs::is_directory(fs::symlink_status(dir_ + "/" + name, ec)), api_, ": '", dir_, "/", name,
                  "' is a folder, where this save writes a file. Move it away.");
    }
    for (const auto& name : staged) {
      TORCH_CHECK(::rename((staging_ + "/" + name).c_str(), (dir_ + "/" + name).c_str()) == 0, api_, ": moving '",
                  name, "' into '", dir_, "' failed: ", errno_text(), ". The rest of the export is in '", staging_,
                  "'.");
    }
    committed_ = true;
    const std::set<std::string> mine(staged.begin(), staged.end());
    for (const auto& name : entriesOf(dir_)) {
      if (stale != nullptr && stale(name) && !mine.count(name) && isOwnEntry(dir_, name, stale, false)) {
        ::unlink((dir_ + "/" + name).c_str());
      }
    }
    removeOwn(staging_, owns_, /*staging=*/true);  // the marker, then the folder
    fsync_dir(dir_);
    return;
  }
  // kReplace. Entries added to the folder since the check are not ours to drop.
  const auto foreign = foreign_entries(dir_, owns_);
  TORCH_CHECK(foreign.empty(), api_, ": '", dir_, "' gained entries dtp did not write while saving: ",
              listed(foreign),
              ". Nothing was replaced; move them away and save again.");
  std::string old = staging_;
  if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, dir_.c_str(), RENAME_EXCHANGE) != 0) {
    TORCH_CHECK(errno == EINVAL || errno == ENOSYS, api_, ": exchanging '", staging_, "' with '", dir_, "' failed: ",
                errno_text(), ".");
    // Filesystems without RENAME_EXCHANGE (NFS): the old folder steps aside
    // first; a crash between the two renames leaves both, named.
    old = dir_ + ".old";
    TORCH_CHECK(!fs::exists(fs::symlink_status(old, ec)), api_, ": '", old, "' is in the way of replacing '", dir_,
                "' on this filesystem. Move it away.");
    TORCH_CHECK(::rename(dir_.c_str(), old.c_str()) == 0, api_, ": moving '", dir_, "' aside failed: ", errno_text(),
                ".");
    committed_ = true;  // from here on both folders stay, whatever happens
    TORCH_CHECK(::rename(staging_.c_str(), dir_.c_str()) == 0, api_, ": replacing '", dir_, "' failed: ",
                errno_text(), ". The previous checkpoint is in '", old, "', the new one in '", staging_, "'.");
  }
  committed_ = true;
  ::unlink((dir_ + "/" + kMarker).c_str());
  const auto left = removeOwn(old, owns_, /*staging=*/false);
  if (!left.empty()) TORCH_WARN(api_, ": the previous '", dir_, "' was kept as '", old, "': it gained ", listed(left), ".");
  fsync_parent(dir_);
}

}  // namespace dtp::io
