/* qm_module.h: the entry points qm_module_multi.c defines for qm_module.c's method table.
 * Include after Python.h. */
#ifndef K3_QM_MODULE_H
#define K3_QM_MODULE_H

#pragma GCC visibility push(hidden)
PyObject *py_matmul_heads(PyObject *self, PyObject *args);
PyObject *py_experts_q8(PyObject *self, PyObject *args);
#pragma GCC visibility pop

#endif
