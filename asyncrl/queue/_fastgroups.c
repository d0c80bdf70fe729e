/* Optional accelerator for the sample stream's group codec (asyncrl/queue/group_codec.py).
 *
 * Two loops run once per response of every group the stream carries, and in CPython they
 * were most of the stream's own CPU time:
 *
 *   columns(trajectories)   the producer's half of prepare_group: read each Trajectory's
 *                           fields, check its token arrays (exact numpy arrays, 1-d, int64 /
 *                           float32 / int64, one logprob and version per response token; a
 *                           loss_mask None or uint8 of the same length) and collect them
 *                           column-wise;
 *   trajectories(...)       the consumer's half of unpack_groups: slice one group's responses
 *                           out of the decoded token columns and build its Trajectory records
 *                           (with the record's turns and loss masks when it carries them).
 *
 * Both only take the path where everything is as expected. On anything else (a field of the
 * wrong type, a length out of bounds, an unknown finish_reason, an array subclass) they
 * return None and group_codec.py runs its pure-Python code, which handles odd-but-valid input and
 * raises CodecError naming what is wrong: the error messages live in one place, and a
 * malformed message can at worst cost the Python path's time here, never a wrong record.
 *
 * Views are made with numpy's C API (PyArray_NewFromDescr + PyArray_SetBaseObject: what
 * basic slicing does, without parsing an index), and fields are read and written through the
 * Trajectory class's own slot descriptors. `setup()` must be called once, by group_codec.py,
 * before the other two.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

enum { F_SID, F_INDEX, F_PROMPT, F_RESPONSE, F_LOGPROBS, F_VERSIONS, F_FINISH, F_REWARD, F_AGE, F_MASK, F_TURNS,
       N_FIELDS };
static const char *const field_names[N_FIELDS] = {
    "sample_id", "index", "prompt_ids", "response_ids", "logprobs", "versions", "finish_reason", "reward", "age",
    "loss_mask", "turns",
};

static PyTypeObject *traj_type;   /* asyncrl.types.Trajectory */
static PyObject *finish_reasons;  /* tuple of the allowed finish_reason strings */
static PyObject *dtype_i8, *dtype_f4, *dtype_u1; /* numpy's dtype singletons of int64, float32, uint8 */
static PyObject *one; /* the int 1: turns of a record that does not carry them */
static PyObject *descr[N_FIELDS]; /* the member descriptors of Trajectory's slots */

static PyObject *
setup(PyObject *self, PyObject *args)
{
    PyObject *cls, *fin, *i8, *f4, *u1;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyType_Type, &cls, &PyTuple_Type, &fin, &PyArrayDescr_Type, &i8,
                          &PyArrayDescr_Type, &f4, &PyArrayDescr_Type, &u1))
        return NULL;
    if (one == NULL && (one = PyLong_FromLong(1)) == NULL)
        return NULL;
    PyObject *found[N_FIELDS];
    for (int k = 0; k < N_FIELDS; k++) {
        found[k] = PyObject_GetAttrString(cls, field_names[k]);
        if (found[k] == NULL || !PyObject_TypeCheck(found[k], &PyMemberDescr_Type)) {
            for (int j = 0; j <= k; j++)
                Py_XDECREF(found[j]);
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "%R.%s is not a slot", cls, field_names[k]);
            return NULL;
        }
    }
    for (int k = 0; k < N_FIELDS; k++)
        Py_XSETREF(descr[k], found[k]);
    Py_INCREF(cls);
    Py_XSETREF(traj_type, (PyTypeObject *)cls);
    Py_INCREF(fin);
    Py_XSETREF(finish_reasons, fin);
    Py_INCREF(i8);
    Py_XSETREF(dtype_i8, i8);
    Py_INCREF(f4);
    Py_XSETREF(dtype_f4, f4);
    Py_INCREF(u1);
    Py_XSETREF(dtype_u1, u1);
    Py_RETURN_NONE;
}

static inline PyObject *
get_field(PyObject *obj, int k)
{
    return Py_TYPE(descr[k])->tp_descr_get(descr[k], obj, (PyObject *)traj_type);
}

static inline int
set_field(PyObject *obj, int k, PyObject *value)
{
    return Py_TYPE(descr[k])->tp_descr_set(descr[k], obj, value);
}

/* True if `a` is an exact numpy array of dtype `dt` (numpy's singleton) with one dimension. */
static inline int
is_typed(PyObject *a, PyObject *dt)
{
    return PyArray_CheckExact(a) && (PyObject *)PyArray_DESCR((PyArrayObject *)a) == dt &&
           PyArray_NDIM((PyArrayObject *)a) == 1;
}

/* columns(trajectories: list) -> (prompt_ids, response_ids, logprobs, versions, index,
 * finish_reason, reward, age, prompt_lens, response_lens, prompt_total, response_total, turns,
 * loss_masks, extended): ten lists, two ints, two lists and a bool (true when a response has a
 * loss mask or turns other than 1); or None when the fast path does not apply. */
enum { N_COLS = 12 };
static PyObject *
columns(PyObject *self, PyObject *ts)
{
    if (traj_type == NULL || !PyList_CheckExact(ts))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(ts);
    PyObject *cols[N_COLS] = {NULL};
    PyObject *result = NULL;
    Py_ssize_t ptotal = 0, rtotal = 0;
    int extended = 0;
    for (int c = 0; c < N_COLS; c++) {
        if ((cols[c] = PyList_New(n)) == NULL)
            goto done;
    }
    /* Allocating the lists may have run the garbage collector (and a finalizer); nothing in
     * the loop below allocates a tracked object, so `ts` cannot change while it runs. */
    if (PyList_GET_SIZE(ts) != n)
        goto bail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(ts, i);
        if (Py_TYPE(t) != traj_type)
            goto bail;
        /* fields in column order: the four arrays, then index, finish, reward, age; turns and
         * loss_mask go to columns 10 and 11 (8 and 9 are the lengths) */
        static const int order[10] = {F_PROMPT, F_RESPONSE, F_LOGPROBS, F_VERSIONS, F_INDEX,
                                      F_FINISH, F_REWARD,   F_AGE,      F_TURNS,    F_MASK};
        for (int c = 0; c < 10; c++) {
            PyObject *v = get_field(t, order[c]);
            if (v == NULL) { /* a slot never set or deleted: the Python path names it */
                if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                    goto done;
                PyErr_Clear();
                goto bail;
            }
            PyList_SET_ITEM(cols[c < 8 ? c : c + 2], i, v);
        }
        PyObject *p = PyList_GET_ITEM(cols[0], i), *r = PyList_GET_ITEM(cols[1], i);
        PyObject *lp = PyList_GET_ITEM(cols[2], i), *v = PyList_GET_ITEM(cols[3], i);
        if (!is_typed(p, dtype_i8) || !is_typed(r, dtype_i8) || !is_typed(lp, dtype_f4) || !is_typed(v, dtype_i8))
            goto bail;
        Py_ssize_t plen = PyArray_DIM((PyArrayObject *)p, 0), rlen = PyArray_DIM((PyArrayObject *)r, 0);
        if (PyArray_DIM((PyArrayObject *)lp, 0) != rlen || PyArray_DIM((PyArrayObject *)v, 0) != rlen)
            goto bail;
        PyObject *turns = PyList_GET_ITEM(cols[10], i), *mask = PyList_GET_ITEM(cols[11], i);
        if (!PyLong_CheckExact(turns))
            goto bail;
        int overflow;
        long tv = PyLong_AsLongAndOverflow(turns, &overflow);
        if (overflow || tv < 0)
            goto bail;
        if (mask != Py_None) {
            if (!is_typed(mask, dtype_u1) || PyArray_DIM((PyArrayObject *)mask, 0) != rlen)
                goto bail;
            extended = 1;
        }
        if (tv != 1)
            extended = 1;
        PyObject *pl = PyLong_FromSsize_t(plen), *rl = PyLong_FromSsize_t(rlen);
        if (pl == NULL || rl == NULL) {
            Py_XDECREF(pl);
            Py_XDECREF(rl);
            goto done;
        }
        PyList_SET_ITEM(cols[8], i, pl);
        PyList_SET_ITEM(cols[9], i, rl);
        ptotal += plen;
        rtotal += rlen;
    }
    result = Py_BuildValue("(NNNNNNNNNNnnNNO)", cols[0], cols[1], cols[2], cols[3], cols[4], cols[5], cols[6], cols[7],
                           cols[8], cols[9], ptotal, rtotal, cols[10], cols[11], extended ? Py_True : Py_False);
    for (int c = 0; c < N_COLS; c++)
        cols[c] = NULL; /* the tuple owns them (or, on failure, Py_BuildValue released them) */
    goto done;
bail:
    result = Py_NewRef(Py_None);
done:
    for (int c = 0; c < N_COLS; c++)
        Py_XDECREF(cols[c]);
    return result;
}

/* 1 and the value if `o` is an exact, non-negative int that fits Py_ssize_t; 0 if not. */
static inline int
as_length(PyObject *o, Py_ssize_t *out)
{
    if (!PyLong_CheckExact(o))
        return 0;
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return v >= 0;
}

/* A 1-d view of `count` items of the 1-d, C-contiguous array `col` from item `start` (the
 * caller checked the bounds): what col[start:start + count] gives, base included. */
static PyObject *
view(PyObject *col, Py_ssize_t start, Py_ssize_t count)
{
    PyArrayObject *a = (PyArrayObject *)col;
    PyArray_Descr *d = PyArray_DESCR(a);
    npy_intp dim = count;
    Py_INCREF(d); /* stolen by PyArray_NewFromDescr */
    PyObject *out = PyArray_NewFromDescr(&PyArray_Type, d, 1, &dim, NULL, PyArray_BYTES(a) + start * PyArray_ITEMSIZE(a),
                                         PyArray_FLAGS(a) & NPY_ARRAY_WRITEABLE, NULL);
    if (out == NULL)
        return NULL;
    Py_INCREF(col);
    if (PyArray_SetBaseObject((PyArrayObject *)out, col) < 0) { /* steals col, even on failure */
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* trajectories(sample_id, index, finish, reward, age, prompt_lens, response_lens,
 *              prompt_ids, response_ids, logprobs, versions, po, ro[, turns, masked, loss_masks])
 * -> (list of Trajectory, po, ro) with po / ro moved past this group's tokens; or None when
 * the fast path does not apply. The six per-response values are lists of one length; the
 * four columns are 1-d arrays (the response columns equally long); po / ro are where this
 * group's prompt and response tokens start. A record that carries turns and masks adds three
 * arguments: turns (ints >= 0) and masked (bools) lists of the same length, and the uint8
 * mask column, as long as the response columns (None when no response is masked). */
static PyObject *
trajectories(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (traj_type == NULL || (nargs != 13 && nargs != 16))
        Py_RETURN_NONE;
    PyObject *turns = NULL, *masked = NULL, *m = NULL;
    if (nargs == 16) {
        turns = args[13], masked = args[14], m = args[15];
        if (!PyList_CheckExact(turns) || !PyList_CheckExact(masked))
            Py_RETURN_NONE;
        if (m != Py_None && !(is_typed(m, dtype_u1) && PyArray_IS_C_CONTIGUOUS((PyArrayObject *)m)))
            Py_RETURN_NONE;
    }
    PyObject *sid = args[0];
    PyObject *const *per = args + 1; /* index, finish, reward, age, plens, rlens */
    PyObject *p = args[7], *r = args[8], *lp = args[9], *v = args[10];
    for (int k = 0; k < 6; k++) {
        if (!PyList_CheckExact(per[k]))
            Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(per[0]);
    for (int k = 1; k < 6; k++) {
        if (PyList_GET_SIZE(per[k]) != n)
            Py_RETURN_NONE;
    }
    Py_ssize_t po, ro;
    if (!as_length(args[11], &po) || !as_length(args[12], &ro))
        Py_RETURN_NONE;
    /* The columns unpack_groups makes: exact, 1-d, C-contiguous arrays, the response ones
     * equally long. Anything else goes the Python way. */
    PyObject *const cols[4] = {p, r, lp, v};
    for (int k = 0; k < 4; k++) {
        if (!PyArray_CheckExact(cols[k]) || PyArray_NDIM((PyArrayObject *)cols[k]) != 1 ||
            !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)cols[k]))
            Py_RETURN_NONE;
    }
    Py_ssize_t np_ = PyArray_DIM((PyArrayObject *)p, 0), nr = PyArray_DIM((PyArrayObject *)r, 0);
    if (PyArray_DIM((PyArrayObject *)lp, 0) != nr || PyArray_DIM((PyArrayObject *)v, 0) != nr)
        Py_RETURN_NONE;
    if (m != NULL && m != Py_None && PyArray_DIM((PyArrayObject *)m, 0) != nr)
        Py_RETURN_NONE;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* The last record's allocation may have run a finalizer: recheck before reading on. */
        for (int k = 0; k < 6; k++) {
            if (PyList_GET_SIZE(per[k]) != n)
                goto bail;
        }
        if (turns != NULL && (PyList_GET_SIZE(turns) != n || PyList_GET_SIZE(masked) != n))
            goto bail;
        PyObject *turn = one;
        int has_mask = 0;
        if (turns != NULL) {
            Py_ssize_t tv;
            turn = PyList_GET_ITEM(turns, i);
            PyObject *flag = PyList_GET_ITEM(masked, i);
            if (!as_length(turn, &tv) || (flag != Py_True && flag != Py_False) || (flag == Py_True && m == Py_None))
                goto bail;
            has_mask = flag == Py_True;
        }
        Py_ssize_t pl, rl;
        if (!as_length(PyList_GET_ITEM(per[4], i), &pl) || !as_length(PyList_GET_ITEM(per[5], i), &rl) ||
            pl > np_ - po || rl > nr - ro)
            goto bail;
        /* An exact str compares with the allowed ones without running any Python code. */
        PyObject *finish = PyList_GET_ITEM(per[1], i);
        if (!PyUnicode_CheckExact(finish))
            goto bail;
        int known = PySequence_Contains(finish_reasons, finish);
        if (known != 1) {
            if (known < 0)
                goto fail;
            goto bail;
        }
        /* Strong references from here on: allocating the record may run the garbage collector. */
        PyObject *values[5] = {PyList_GET_ITEM(per[0], i), finish, PyList_GET_ITEM(per[2], i),
                               PyList_GET_ITEM(per[3], i), turn};
        for (int k = 0; k < 5; k++)
            Py_INCREF(values[k]);
        PyObject *t = traj_type->tp_alloc(traj_type, 0);
        PyObject *views[5] = {NULL, NULL, NULL, NULL, NULL};
        int failed = t == NULL;
        if (!failed) {
            PyList_SET_ITEM(out, i, t);
            views[0] = view(p, po, pl);
            views[1] = view(r, ro, rl);
            views[2] = view(lp, ro, rl);
            views[3] = view(v, ro, rl);
            views[4] = has_mask ? view(m, ro, rl) : Py_NewRef(Py_None);
            failed = views[0] == NULL || views[1] == NULL || views[2] == NULL || views[3] == NULL || views[4] == NULL ||
                     set_field(t, F_SID, sid) || set_field(t, F_INDEX, values[0]) || set_field(t, F_PROMPT, views[0]) ||
                     set_field(t, F_RESPONSE, views[1]) || set_field(t, F_LOGPROBS, views[2]) ||
                     set_field(t, F_VERSIONS, views[3]) || set_field(t, F_FINISH, values[1]) ||
                     set_field(t, F_REWARD, values[2]) || set_field(t, F_AGE, values[3]) ||
                     set_field(t, F_MASK, views[4]) || set_field(t, F_TURNS, values[4]);
        }
        for (int k = 0; k < 5; k++) {
            Py_XDECREF(views[k]);
            Py_DECREF(values[k]);
        }
        if (failed)
            goto fail;
        po += pl;
        ro += rl;
    }
    return Py_BuildValue("(Nnn)", out, po, ro);
bail:
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(Trajectory, FINISH_REASONS, dtype('int64'), dtype('float32'), dtype('uint8')): bind the types"},
    {"columns", columns, METH_O, "columns(trajectories) -> the prepare_group columns, or None"},
    {"trajectories", (PyCFunction)(void (*)(void))trajectories, METH_FASTCALL,
     "trajectories(sid, index, finish, reward, age, plens, rlens, p, r, lp, v, po, ro[, turns, masked, m])"
     " -> (list, po, ro), or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastgroups", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__fastgroups(void)
{
    import_array();
    return PyModule_Create(&module);
}
