/* libaio's interface, the part DeepSpeed's async_io op uses, over the Linux AIO system calls.
 *
 * For a machine without libaio's headers and library (its package not installed and no network to install it), so
 * that DeepSpeed's async_io op, and with it ZeRO-Infinity's NVMe offload, builds there for a comparison with
 * stronghold's NVMe tier. libaio itself is a thin layer over the same system calls (io_setup, io_submit,
 * io_getevents, io_destroy), so the I/O path the kernel runs is the same. The structures are the kernel's
 * (linux/aio_abi.h) under libaio's names; libaio.c checks the layout against the kernel's header when it compiles.
 * 64-bit little-endian Linux only (x86_64, aarch64). build.sh compiles libaio.so beside this header.
 */
#ifndef STRONGHOLD_LIBAIO_SHIM_H
#define STRONGHOLD_LIBAIO_SHIM_H

#include <signal.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct io_context *io_context_t;

typedef enum io_iocb_cmd {
    IO_CMD_PREAD = 0,
    IO_CMD_PWRITE = 1,
    IO_CMD_FSYNC = 2,
    IO_CMD_FDSYNC = 3,
    IO_CMD_NOOP = 6,
    IO_CMD_PREADV = 7,
    IO_CMD_PWRITEV = 8,
} io_iocb_cmd_t;

struct io_iocb_common {
    void *buf;
    unsigned long nbytes;
    long long offset;
    long long reserved2;
    unsigned flags;
    unsigned resfd;
};

struct iocb {
    void *data; /* returned in the completion's io_event.data */
    unsigned key;
    int aio_rw_flags;
    short aio_lio_opcode;
    short aio_reqprio;
    int aio_fildes;
    union {
        struct io_iocb_common c;
    } u;
};

struct io_event {
    void *data;
    struct iocb *obj;
    long res;  /* bytes transferred, or a negative errno */
    long res2;
};

/* Each returns what the system call does on success and -errno on failure, as libaio's do. */
int io_setup(int maxevents, io_context_t *ctxp);
int io_destroy(io_context_t ctx);
int io_queue_init(int maxevents, io_context_t *ctxp);
int io_queue_release(io_context_t ctx);
int io_submit(io_context_t ctx, long nr, struct iocb *ios[]);
int io_cancel(io_context_t ctx, struct iocb *iocb, struct io_event *event);
int io_getevents(io_context_t ctx, long min_nr, long nr, struct io_event *events, struct timespec *timeout);
int io_pgetevents(io_context_t ctx, long min_nr, long nr, struct io_event *events, struct timespec *timeout,
                  sigset_t *sigmask);

static inline void io_prep_rw(struct iocb *iocb, int opcode, int fd, void *buf, size_t count, long long offset)
{
    memset(iocb, 0, sizeof(*iocb));
    iocb->aio_fildes = fd;
    iocb->aio_lio_opcode = (short)opcode;
    iocb->u.c.buf = buf;
    iocb->u.c.nbytes = count;
    iocb->u.c.offset = offset;
}

static inline void io_prep_pread(struct iocb *iocb, int fd, void *buf, size_t count, long long offset)
{
    io_prep_rw(iocb, IO_CMD_PREAD, fd, buf, count, offset);
}

static inline void io_prep_pwrite(struct iocb *iocb, int fd, void *buf, size_t count, long long offset)
{
    io_prep_rw(iocb, IO_CMD_PWRITE, fd, buf, count, offset);
}

#ifdef __cplusplus
}
#endif

#endif
