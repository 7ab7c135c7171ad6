#include "io/atomic_dir.h"

#include "io/file_util.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <stdio.h>

#include <cerrno>
#include <filesystem>

namespace dtp::io {

namespace fs = std::filesystem;

namespace {

// "ck/" and "ck" name the same folder.
std::string trimmed(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

}  // namespace

std::string incomplete_dir(const std::string& dir) { return trimmed(dir) + ".incomplete"; }

void prepare_incomplete_dir(const std::string& dir) {
  const std::string tmp = incomplete_dir(dir);
  std::error_code ec;
  fs::remove_all(tmp, ec);
  TORCH_CHECK(!ec, "save: cannot remove the stale '", tmp, "' (", ec.message(), "). Remove it by hand.");
  const fs::path parent = fs::absolute(tmp).parent_path();
  fs::create_directories(parent, ec);
  TORCH_CHECK(!ec, "save: cannot create '", parent.string(), "' (", ec.message(), "). Check the path and permissions.");
  fs::create_directory(tmp, ec);
  TORCH_CHECK(!ec, "save: cannot create '", tmp, "' (", ec.message(), "). Check the path and permissions.");
}

void commit_dir(const std::string& dir) {
  const std::string tmp = incomplete_dir(dir);
  const std::string target = trimmed(dir);
  fsync_dir(tmp);
  std::error_code ec;
  if (!fs::exists(target, ec)) {
    TORCH_CHECK(::rename(tmp.c_str(), target.c_str()) == 0, "save: renaming '", tmp, "' to '", target,
                "' failed: ", errno_text(), ". The new checkpoint is complete in '", tmp, "'; rename it by hand.");
  } else {
    TORCH_CHECK(fs::is_directory(target, ec), "save: '", target, "' exists and is not a folder (an old single-file "
                "checkpoint?). Save to another path or move it away.");
    // One atomic step: the new folder takes the name, the old one takes the
    // temporary name and is removed after.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
      TORCH_CHECK(errno == EINVAL || errno == ENOSYS, "save: exchanging '", tmp, "' with '", target, "' failed: ",
                  errno_text(), ". The new checkpoint is complete in '", tmp, "'.");
      // Filesystems without RENAME_EXCHANGE (NFS): the old folder steps aside
      // first; a crash between the two renames leaves both, named.
      const std::string old = target + ".old";
      fs::remove_all(old, ec);
      TORCH_CHECK(::rename(target.c_str(), old.c_str()) == 0 && ::rename(tmp.c_str(), target.c_str()) == 0,
                  "save: replacing '", target, "' failed: ", errno_text(), ". The previous checkpoint is in '", old,
                  "', the new one in '", tmp, "'.");
      fs::remove_all(old, ec);
    } else {
      fs::remove_all(tmp, ec);
    }
  }
  fsync_parent(target);
}

}  // namespace dtp::io
