// Small POSIX helpers shared by dtp's checkpoint writers and readers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dtp::io {

// strerror of errno, e.g. "No space left on device".
std::string errno_text();
// write(2) until done; false with errno set on failure.
bool write_all(int fd, const void* data, size_t n);
// pwrite(2) until done; false with errno set on failure.
bool pwrite_all(int fd, const void* data, size_t n, uint64_t offset);
// Writes `text` to a new file at `path` (an existing one is an error, never
// replaced) and fsyncs it; errors name the path and the cause (a full disk:
// "No space left on device").
void write_file_synced(const std::string& path, const std::string& text);
// Best effort: persist a rename or a new entry in `path`'s directory (some
// filesystems refuse to fsync a directory).
void fsync_parent(const std::string& path);
void fsync_dir(const std::string& dir);

}  // namespace dtp::io
