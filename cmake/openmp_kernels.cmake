# NOTE: [OpenMP in dtp's kernels]
# at::parallel_for is inline (ATen/Parallel.h). Where libtorch runs its
# intra-op threads on OpenMP (ATen/Config.h: AT_PARALLEL_OPENMP 1, as in
# Debian's libtorch and the pip wheel), its loop is a `#pragma omp parallel`
# compiled into the caller: in an object built without -fopenmp it runs on
# the calling thread alone, whatever at::set_num_threads says. So dtp's own
# CPU kernels that split work with at::parallel_for are compiled with
# -fopenmp, skip the precompiled header (built without _OPENMP, which decides
# the inline loop), and dtp links the OpenMP runtime libtorch itself loads:
# the libgomp in libtorch's folder, the pip wheel's bundled
# libgomp-<hash>.so.1 first, Debian's libgomp.so.1 otherwise. One runtime,
# one thread pool, one at::set_num_threads for ATen and dtp. Without such a
# libgomp, with another compiler than GCC, or with a libtorch on its native
# thread pool (whose at::parallel_for is not inline), the files build as
# before: serial in the first two cases, with a warning.
#
# dtp_openmp_kernels(TARGET SOURCES...) applies this to SOURCES of TARGET and
# sets DTP_KERNELS_WITH_OPENMP where it did.
function(dtp_openmp_kernels target)
  find_file(DTP_ATEN_CONFIG ATen/Config.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
  set(openmp OFF)
  if(DTP_ATEN_CONFIG)
    file(STRINGS "${DTP_ATEN_CONFIG}" openmp REGEX "#define AT_PARALLEL_OPENMP 1")
  endif()
  if(NOT openmp)
    message(STATUS "dtp: libtorch is not on OpenMP; at::parallel_for in dtp's kernels needs no -fopenmp")
    return()
  endif()
  get_filename_component(torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
  file(GLOB gomp "${torch_lib_dir}/libgomp-*.so*")
  if(NOT gomp)
    file(GLOB gomp "${torch_lib_dir}/libgomp.so.1")
  endif()
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU" OR NOT gomp)
    message(WARNING "dtp: no libgomp beside ${TORCH_LIBRARY}, or not GCC: dtp's own CPU kernels (weight-only "
                    "linears, per-shard random numbers, the GEMV) run on one thread (NOTE: [OpenMP in dtp's kernels])")
    return()
  endif()
  list(GET gomp 0 gomp)
  message(STATUS "dtp: dtp's CPU kernels use libtorch's OpenMP runtime ${gomp}")
  set_property(SOURCE ${ARGN} APPEND PROPERTY COMPILE_OPTIONS -fopenmp)
  set_source_files_properties(${ARGN} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
  set_property(SOURCE ${ARGN} APPEND PROPERTY COMPILE_DEFINITIONS DTP_KERNELS_WITH_OPENMP)
  target_link_libraries(${target} PRIVATE "${gomp}")
  set(DTP_KERNELS_WITH_OPENMP ON PARENT_SCOPE)  # for the tests that check the threads
endfunction()
