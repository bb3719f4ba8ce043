/*
 * zshard._zshard built for CPython's stable ABI (Py_LIMITED_API = 3.11, the
 * "abi3" module tests/gpu/bundle ships): one binary that loads on 3.11, 3.12
 * and later. Included by internal.h (so by every file of the extension) only
 * when Py_LIMITED_API is defined; the ordinary build (Debian's interpreter)
 * never sees this file.
 *
 * The limited API lacks the unchecked accessor macros and the PyTypeObject
 * layout. The macros below map the accessors the extension uses onto their
 * checked functions (same borrowed/stolen reference rules), and turn each
 * type object into a pointer filled at import by PyType_FromSpec /
 * PyStructSequence_NewType (module.c's PyInit__zshard), so that `&zspy__client_type`
 * still names the type.
 */
#ifndef ZSHARD_PY_LIMITED_H
#define ZSHARD_PY_LIMITED_H

#define PyUnicode_AsUTF8(o) PyUnicode_AsUTF8AndSize((o), NULL)
#define PyTuple_GET_SIZE(o) PyTuple_Size(o)
#define PyTuple_GET_ITEM(o, i) PyTuple_GetItem((o), (i))
#define PyList_GET_SIZE(o) PyList_Size(o)
#define PyDict_GET_SIZE(o) PyDict_Size(o)
#define PyList_GET_ITEM(o, i) PyList_GetItem((o), (i))
/* Only ever used on a new list's empty slot: PyList_SetItem steals as the
 * macro does, and there is no old item to release. */
#define PyList_SET_ITEM(o, i, v) ((void)PyList_SetItem((o), (i), (v)))
#define PyStructSequence_SET_ITEM(o, i, v) PyStructSequence_SetItem((o), (i), (v))
#define PyStructSequence_GET_ITEM(o, i) PyStructSequence_GetItem((o), (i))

/* The limited API's reference counting takes PyObject * only; the extension
 * passes its own object structs, whose first member is the PyObject head. */
#undef Py_INCREF
#undef Py_DECREF
#undef Py_XINCREF
#undef Py_XDECREF
#define Py_INCREF(o) Py_IncRef((PyObject *)(o))
#define Py_DECREF(o) Py_DecRef((PyObject *)(o))
#define Py_XINCREF(o) Py_IncRef((PyObject *)(o))
#define Py_XDECREF(o) Py_DecRef((PyObject *)(o))

/* The type objects, created at import. */
#define zspy__timing_type (*zspy__timing_type_p)
#define zspy__step_result_type (*zspy__step_result_type_p)
#define zspy__client_type (*zspy__client_type_p)
#define zspy__request_type (*zspy__request_type_p)

#endif
