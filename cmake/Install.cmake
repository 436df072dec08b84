# `cmake --install build [--prefix P]`: the public headers, libepmoe.so, a CMake package
# (find_package(epmoe) gives the imported target epmoe::epmoe) and a pkg-config file (epmoe.pc).
include(CMakePackageConfigHelpers)

set(EPMOE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/epmoe)
install(TARGETS epmoe_shared EXPORT epmoeTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/epmoe DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT epmoeTargets NAMESPACE epmoe:: DESTINATION ${EPMOE_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/epmoeConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/epmoeConfig.cmake INSTALL_DESTINATION ${EPMOE_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/epmoeConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/epmoeConfig.cmake ${PROJECT_BINARY_DIR}/epmoeConfigVersion.cmake
        DESTINATION ${EPMOE_CMAKE_DIR})
# The prefix relative to the .pc file, so `--prefix` at install time still gives right paths.
file(RELATIVE_PATH EPMOE_PC_TO_PREFIX /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
configure_file(${PROJECT_SOURCE_DIR}/cmake/epmoe.pc.in ${PROJECT_BINARY_DIR}/epmoe.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/epmoe.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
