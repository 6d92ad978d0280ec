# Install rules for C++ users: the two static libraries, the public headers
# and a CMake package, so that
#
#   find_package(fp4moe REQUIRED)            # CMAKE_PREFIX_PATH = the install prefix
#   target_link_libraries(app PRIVATE fp4moe::fp4moe)
#
# works like add_subdirectory(fp4moe) + target_link_libraries(app PRIVATE fp4moe).
# Everything goes into the "Development" component; the Python wheel installs
# only its own component (pyproject.toml), so none of this lands in a wheel.
# Tested by tests/install/ (install, then a consumer project with find_package).
include(CMakePackageConfigHelpers)

set(FP4MOE_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/fp4moe")

install(TARGETS fp4moe_core fp4moe
        EXPORT fp4moeTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT Development
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT Development)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/fp4moe
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT Development)
install(EXPORT fp4moeTargets NAMESPACE fp4moe:: DESTINATION ${FP4MOE_CMAKE_DIR}
        COMPONENT Development)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/fp4moeConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/fp4moeConfig.cmake
                              INSTALL_DESTINATION ${FP4MOE_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/fp4moeConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/fp4moeConfig.cmake ${PROJECT_BINARY_DIR}/fp4moeConfigVersion.cmake
        DESTINATION ${FP4MOE_CMAKE_DIR} COMPONENT Development)
