/* The Python type _native.Core (core_type.c) as the module sees it. */
#ifndef TSR_CORE_TYPE_H
#define TSR_CORE_TYPE_H

#include "common.h"

/* Ready the type and add it to module m as "Core"; -1 with an exception set. */
int core_type_add(PyObject *m);

#endif
