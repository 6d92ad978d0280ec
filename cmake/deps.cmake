# Third-party dependencies, all from Debian packages:
#   nlohmann-json3-dev (JSON; header-only, used inside the libraries),
#   libcli11-dev (CLI parsing, FP4MOE_BUILD_CLI), googletest (tests).
# On a machine without a package registry (the GPU machine), scripts/fetch-deps
# unpacks the same packages into .deps/ beforehand; FP4MOE_DEPS_DIR points there.
set(FP4MOE_DEPS_DIR "${PROJECT_SOURCE_DIR}/.deps" CACHE PATH "Unpacked Debian packages (optional)")
if(EXISTS "${FP4MOE_DEPS_DIR}/usr")
  list(PREPEND CMAKE_PREFIX_PATH "${FP4MOE_DEPS_DIR}/usr")
endif()

find_package(nlohmann_json 3.10 QUIET)
if(NOT nlohmann_json_FOUND)
  find_path(NLOHMANN_JSON_INCLUDE nlohmann/json.hpp HINTS "${FP4MOE_DEPS_DIR}/usr/include" REQUIRED)
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
  target_include_directories(nlohmann_json::nlohmann_json INTERFACE ${NLOHMANN_JSON_INCLUDE})
endif()

if(FP4MOE_BUILD_CLI)
  find_path(CLI11_INCLUDE CLI/CLI.hpp HINTS "${FP4MOE_DEPS_DIR}/usr/include")
  if(NOT CLI11_INCLUDE)
    message(FATAL_ERROR "CLI11 not found: apt-get install libcli11-dev (or run scripts/fetch-deps)")
  endif()
  add_library(fp4moe_cli11 INTERFACE)
  target_include_directories(fp4moe_cli11 SYSTEM INTERFACE ${CLI11_INCLUDE})
endif()

if(FP4MOE_BUILD_TESTS)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND)
    set(_gtest_src "${FP4MOE_DEPS_DIR}/usr/src/googletest")
    if(NOT EXISTS "${_gtest_src}/CMakeLists.txt")
      set(_gtest_src "/usr/src/googletest")
    endif()
    if(NOT EXISTS "${_gtest_src}/CMakeLists.txt")
      message(FATAL_ERROR "GoogleTest not found: apt-get install libgtest-dev googletest (or run scripts/fetch-deps)")
    endif()
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory(${_gtest_src} ${CMAKE_BINARY_DIR}/_deps/googletest EXCLUDE_FROM_ALL)
    add_library(GTest::gtest ALIAS gtest)
    add_library(GTest::gtest_main ALIAS gtest_main)
  endif()
  include(GoogleTest)
endif()
