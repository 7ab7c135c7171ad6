# Runs a gtest binary under a filter, for add_test:
#   cmake -DEXE=<binary> -DFILTER=<gtest filter> -DOUT=<json file> -P gtest_check.cmake
# Passes only when the binary exits 0, no test was skipped, and each positive
# pattern of the filter named at least one test that ran. A renamed test then
# fails the check instead of quietly running nothing, and a new test that the
# filter matches cannot break it (counting "PASSED ] N tests" could).
cmake_minimum_required(VERSION 3.19)  # string(JSON)

foreach(var EXE FILTER OUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "gtest_check.cmake: -D${var}=... is missing. Call it as "
                        "cmake -DEXE=<binary> -DFILTER=<gtest filter> -DOUT=<json file> -P gtest_check.cmake.")
  endif()
endforeach()

file(REMOVE "${OUT}")
execute_process(COMMAND "${EXE}" "--gtest_filter=${FILTER}" "--gtest_output=json:${OUT}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gtest_check: ${EXE} --gtest_filter=${FILTER} exited with ${rc}, expected 0.")
endif()
if(NOT EXISTS "${OUT}")
  message(FATAL_ERROR "gtest_check: ${EXE} wrote no ${OUT}; it needs --gtest_output=json (googletest 1.8.1 or newer).")
endif()

# Every test that ran, as Suite.Name; a skipped one fails the check.
file(READ "${OUT}" json)
set(ran "")
string(JSON n_suites LENGTH "${json}" testsuites)
if(n_suites GREATER 0)
  math(EXPR last_suite "${n_suites} - 1")
  foreach(i RANGE ${last_suite})
    string(JSON suite GET "${json}" testsuites ${i} name)
    string(JSON n_tests LENGTH "${json}" testsuites ${i} testsuite)
    if(n_tests EQUAL 0)
      continue()
    endif()
    math(EXPR last_test "${n_tests} - 1")
    foreach(j RANGE ${last_test})
      string(JSON name GET "${json}" testsuites ${i} testsuite ${j} name)
      string(JSON result GET "${json}" testsuites ${i} testsuite ${j} result)
      if(result STREQUAL "SKIPPED")
        message(FATAL_ERROR "gtest_check: ${suite}.${name} was skipped, expected it to run.")
      endif()
      list(APPEND ran "${suite}.${name}")
    endforeach()
  endforeach()
endif()

# Each positive pattern (before any '-') must name a test that ran.
string(REGEX REPLACE "-.*$" "" positive "${FILTER}")
string(REPLACE ":" ";" patterns "${positive}")
foreach(pattern IN LISTS patterns)
  string(REPLACE "." "\\." rx "${pattern}")  # test names hold no other regex character
  string(REPLACE "*" ".*" rx "${rx}")
  string(REPLACE "?" "." rx "${rx}")
  set(found FALSE)
  foreach(test IN LISTS ran)
    if(test MATCHES "^${rx}$")
      set(found TRUE)
      break()
    endif()
  endforeach()
  if(NOT found)
    message(FATAL_ERROR "gtest_check: no test that ran matches '${pattern}' of the filter; ran: ${ran}. "
                        "A test was renamed or removed: update the filter.")
  endif()
endforeach()
list(LENGTH ran n_ran)
message(STATUS "gtest_check: ${n_ran} tests ran and passed; each pattern of ${positive} named at least one")
