# Writes OUTPUT: one ctest entry per GoogleTest suite of TEST_EXECUTABLE
# (`Suite`, running --gtest_filter=Suite.*), read off --gtest_list_tests after
# each build of it. See NOTE: [One ctest entry per suite] in CMakeLists.txt.
#
#   cmake -DTEST_EXECUTABLE=... -DOUTPUT=... -DTIMEOUT=600 -DWORKING_DIRECTORY=... -P ctest_suites.cmake
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
                WORKING_DIRECTORY "${WORKING_DIRECTORY}"
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ctest_suites: '${TEST_EXECUTABLE} --gtest_list_tests' failed (${rc}): ${errors}\n"
                      "Run it by hand to see why; no ctest entries were written.")
endif()
# A suite's line starts in column 0 and ends its name with a dot (typed and
# parameterized suites too: "Meshes/OpsTest." or "Typed/0.  # TypeParam = ...");
# its cases follow, indented.
string(REGEX MATCHALL "(^|\n)[^ \n#][^ \n]*\\." suites "${listing}")
set(content "")
set(count 0)
foreach(line IN LISTS suites)
  string(STRIP "${line}" suite)
  string(REGEX REPLACE "\\.$" "" suite "${suite}")
  string(APPEND content
         "add_test([=[${suite}]=] [=[${TEST_EXECUTABLE}]=] [=[--gtest_filter=${suite}.*]=])\n"
         "set_tests_properties([=[${suite}]=] PROPERTIES TIMEOUT ${TIMEOUT} "
         "WORKING_DIRECTORY [=[${WORKING_DIRECTORY}]=])\n")
  math(EXPR count "${count} + 1")
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "ctest_suites: '${TEST_EXECUTABLE} --gtest_list_tests' listed no suite.")
endif()
file(WRITE "${OUTPUT}" "${content}")
