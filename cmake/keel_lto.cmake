# Link-time optimisation (the release preset) without making every test program pay for it.
# The library's objects (and the torture harness's) carry machine code too (fat), and the
# tests, the fuzz replays and the torture harness link that as it is (-fno-lto): only the
# programs users run and measure, and libkeel.so, optimise the library at link time, once each,
# instead of every test program again (30-60 s each).

# Objects of `target` that both kinds of program link.
function(keel_fat_lto_objects target)
  if(CMAKE_INTERPROCEDURAL_OPTIMIZATION)
    target_compile_options(${target} PRIVATE -ffat-lto-objects)
  endif()
endfunction()

# Every program of the calling directory links without link-time optimisation (a macro: the
# settings are the directory's).
macro(keel_link_without_lto)
  if(CMAKE_INTERPROCEDURAL_OPTIMIZATION)
    set(CMAKE_INTERPROCEDURAL_OPTIMIZATION OFF)
    add_link_options(-fno-lto)
  endif()
endmacro()
