"""A stand-in fork named like torchtitan (tests only): upstream's package layout, the library's sections."""
