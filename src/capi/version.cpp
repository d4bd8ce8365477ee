// libmok.so is mok_core linked whole; this file only gives the shared library a source.
#include "mok/mok.h"
