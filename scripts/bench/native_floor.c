/* The native floor for scripts/bench/mount_hits.py: the least a FUSE server can do per file.
 *
 * A libfuse low-level server in C, multi-threaded, answering exactly what the quiverfs mount
 * answers on a warm hit and nothing more: LOOKUP from a hash table built at start, GETATTR,
 * OPEN/OPENDIR with ENOSYS (zero-message opens, the kernel keeps pages), IOCTL with ENOTTY,
 * READ with one pread of the store file. No Python, no digest, no counters: whatever this
 * reaches on a machine is what the kernel's FUSE protocol allows there, so the benchmark can
 * tell the mount's own cost from the machine's.
 *
 * Usage: native_floor MOUNTPOINT LISTFILE
 * LISTFILE: one line per file, "NAME\tSTORE_PATH\tSIZE" (names flat, in the root directory).
 * Runs in the foreground until unmounted (fusermount3 -u MOUNTPOINT).
 */
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TIMEOUT 86400.0

struct file {
    char *name;
    char *store;
    off_t size;
};

static struct file *files;     /* inode i (>= 2) is files[i - 2] */
static size_t nfiles;
static size_t *slots;          /* open addressing: index + 1, 0 = empty */
static size_t nslots;

static size_t hash_name(const char *s) {
    size_t h = 1469598103934665603ULL;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

static void index_names(void) {
    nslots = 4;
    while (nslots < nfiles * 2) nslots <<= 1;
    slots = calloc(nslots, sizeof *slots);
    for (size_t i = 0; i < nfiles; i++) {
        size_t s = hash_name(files[i].name) & (nslots - 1);
        while (slots[s]) s = (s + 1) & (nslots - 1);
        slots[s] = i + 1;
    }
}

static long find(const char *name) {
    size_t s = hash_name(name) & (nslots - 1);
    for (; slots[s]; s = (s + 1) & (nslots - 1))
        if (strcmp(files[slots[s] - 1].name, name) == 0) return (long)slots[s] - 1;
    return -1;
}

static void fill(fuse_ino_t ino, struct stat *st) {
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    st->st_nlink = 1;
    st->st_uid = getuid();
    st->st_gid = getgid();
    if (ino == FUSE_ROOT_ID) {
        st->st_mode = S_IFDIR | 0555;
    } else {
        st->st_mode = S_IFREG | 0444;
        st->st_size = files[ino - 2].size;
    }
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    long i = parent == FUSE_ROOT_ID ? find(name) : -1;
    if (i < 0) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    struct fuse_entry_param e;
    memset(&e, 0, sizeof e);
    e.ino = (fuse_ino_t)i + 2;
    e.attr_timeout = e.entry_timeout = TIMEOUT;
    fill(e.ino, &e.attr);
    fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)fi;
    struct stat st;
    if (ino != FUSE_ROOT_ID && (ino < 2 || ino - 2 >= nfiles)) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    fill(ino, &st);
    fuse_reply_attr(req, &st, TIMEOUT);
}

static void op_enosys(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino;
    (void)fi;
    fuse_reply_err(req, ENOSYS);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)fi;
    if (ino < 2 || ino - 2 >= nfiles) {
        fuse_reply_err(req, EIO);
        return;
    }
    int fd = open(files[ino - 2].store, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fuse_reply_err(req, EIO);
        return;
    }
    char *buf = malloc(size);
    ssize_t n = pread(fd, buf, size, off);
    close(fd);
    if (n < 0) fuse_reply_err(req, EIO);
    else fuse_reply_buf(req, buf, (size_t)n);
    free(buf);
}

static void op_ioctl(fuse_req_t req, fuse_ino_t ino, int cmd, void *arg, struct fuse_file_info *fi,
                     unsigned flags, const void *in, size_t in_size, size_t out_size) {
    (void)ino; (void)cmd; (void)arg; (void)fi; (void)flags; (void)in; (void)in_size; (void)out_size;
    fuse_reply_err(req, ENOTTY);
}

static void load(const char *listfile) {
    FILE *f = fopen(listfile, "r");
    if (!f) {
        perror(listfile);
        exit(2);
    }
    size_t cap = 1024;
    files = malloc(cap * sizeof *files);
    char line[8192];
    while (fgets(line, sizeof line, f)) {
        char *name = strtok(line, "\t"), *store = strtok(NULL, "\t"), *size = strtok(NULL, "\n");
        if (!name || !store || !size) continue;
        if (nfiles == cap) files = realloc(files, (cap *= 2) * sizeof *files);
        files[nfiles++] = (struct file){strdup(name), strdup(store), (off_t)strtoll(size, NULL, 10)};
    }
    fclose(f);
    index_names();
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MOUNTPOINT LISTFILE\n", argv[0]);
        return 2;
    }
    load(argv[2]);
    static const struct fuse_lowlevel_ops ops = {
        .lookup = op_lookup, .getattr = op_getattr, .open = op_enosys, .opendir = op_enosys,
        .read = op_read, .ioctl = op_ioctl,
    };
    char *fargv[] = {argv[0], "-o", "ro", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (!se || fuse_session_mount(se, argv[1]) != 0) return 1;
    struct fuse_loop_config *config = fuse_loop_cfg_create();
    int rc = fuse_session_loop_mt(se, config);
    fuse_loop_cfg_destroy(config);
    fuse_session_unmount(se);
    fuse_session_destroy(se);
    return rc;
}
