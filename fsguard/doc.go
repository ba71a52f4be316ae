// Package fsguard is fenceline's file-write guard: it runs an agent's
// command so that it writes only what its lease allows, stops every write
// the moment the lease is lost or unknown (reads go on), and reports the
// attempt settled only once every process it started is gone.
//
// # Layers
//
// Landlock is the boundary. The guarded command runs in a Landlock domain
// that grants writes only beneath Policy.Writable (the leased paths under
// the worktree, the extras of the policy, the git dirs of an exclusive
// workspace), a private temp dir (TMPDIR) and a few devices (/dev/null,
// ttys); reads and execution everywhere except Policy.Hidden; and, with
// ABI >= 4, TCP connect only to Policy.ConnectPorts (the sidecar's ports)
// and TCP bind only to a port the kernel chooses or Policy.BindPorts.
// With ABI >= 6 the agent cannot signal processes outside its domain (the
// sidecar) nor reach abstract Unix sockets made outside it. The kernel checks every open, create, rename, link, unlink and
// truncate itself, after resolving symlinks, "..", /proc/self/fd magic links
// and hard links, for static binaries as much as for libc programs.
// Landlock rules only add rights, so a shared-workspace lease never makes the
// worktree root writable: .git cannot be carved out of a writable tree, and
// Validate refuses a shared policy whose writable paths cover a git dir.
// Hiding a path means granting read on everything else: full read on every
// sibling along the way from / to it, directory listing only on its
// ancestors (names stay visible, contents do not).
//
// A seccomp filter handles what must change at run time. Installed with
// SECCOMP_FILTER_FLAG_NEW_LISTENER, it sends every write-class system call to
// the supervisor (open/openat only with O_WRONLY, O_RDWR, O_CREAT, O_TRUNC or
// O_APPEND — decided in the filter, no round trip for reads; openat2, creat,
// rename*, unlink*, mkdir*, rmdir, link*, symlink*, mknod*, truncate,
// ftruncate, fallocate, chmod/chown/utimes families and xattr writes
// always; ioctl only for the requests below). While Gate.Fence succeeds
// the supervisor answers a write-open or a namespace change CONTINUE: that
// is not an allow decision — the call then meets Landlock in the kernel, so
// the time-of-check/time-of-use hole of CONTINUE grants nothing. Once the
// gate fails it answers EACCES, counts the denial (Process.Refusals keeps
// those refused after the loss apart from those refused for what they are,
// outside the claim or never allowed) and records an audit
// event (boundary "file") naming the lease, owner, fence, reason, the call
// and its path (read from /proc/PID/mem, trusted only after
// SECCOMP_IOCTL_NOTIF_ID_VALID). A read-only openat2 while the lease is lost
// gets ENOSYS, so libc and Go fall back to openat, which the filter checks
// without trusting CONTINUE. The filter kills foreign-architecture and x32
// calls and refuses io_uring_setup (io_uring operations bypass seccomp).
//
// What Landlock does not govern the supervisor performs itself, never
// answering CONTINUE after a check the agent could race (emulate_linux.go,
// ioctl_linux.go):
//   - Terminal input injection (ioctl TIOCSTI, TIOCLINUX) is refused
//     always with EPERM, audited with reason not-allowed.
//   - Inode ioctls (FS_IOC_SETFLAGS = chattr, FS_IOC_FSSETXATTR,
//     FS_IOC_SETVERSION, their 32-bit forms, FS_IOC_ENABLE_VERITY,
//     FS_IOC_SET_ENCRYPTION_POLICY) work on read-only descriptors. While
//     the lease holds the supervisor duplicates the task's descriptor
//     (pidfd_getfd: a dup2 onto the number afterwards changes nothing),
//     checks the real path of its duplicate against the writable set
//     (resolved with EvalSymlinks at Start) and the temp dir, copies the
//     argument and performs the ioctl on the duplicate; outside, EACCES
//     with reason outside-lease. After the loss, refused.
//   - Metadata (chmod, chown, utimes and xattr families, and file_setattr,
//     Linux 6.17's FS_IOC_FSSETXATTR by path) likewise: the
//     target is resolved once into an O_PATH descriptor of the supervisor
//     (relative to the task's dirfd or cwd through /proc/PID; /proc/self
//     and /dev/fd spelled by the task mean the task's), judged by its real
//     path, and changed through that descriptor (AT_EMPTY_PATH or
//     /proc/self/fd/N) with the values copied from the task. A symlink
//     swapped meanwhile redirects nothing.
//   - After the loss, reads that write somewhere harmless go on. A
//     write-open, mkdir, unlink, rmdir or rename spelled beneath the
//     private temp dir is performed beneath the supervisor's descriptor of
//     the dir (openat2 RESOLVE_BENEATH: a symlink or ".." out of it fails;
//     an existing regular file with other hard links is refused, it may be
//     a leased file linked there while the lease held; new files are made
//     O_EXCL under the task's umask). A write-open of /dev/null, /dev/zero,
//     /dev/full, a pty, /dev/ptmx, the task's terminal or a pipe the task
//     holds itself (/dev/stdout on a pipe) is resolved O_PATH, checked with
//     fstat and reopened through /proc/self/fd. The supervisor resolves
//     with its own credentials, so another process's pipe
//     (/proc/PID/fd/N) and a named FIFO outside the temp dir are refused
//     (TestLostLeaseForeignPipesRefused). Each new descriptor is handed over
//     with SECCOMP_IOCTL_NOTIF_ADDFD. Everything else stays refused.
//
// The git shim is convenience, not enforcement: with Policy.GitShim a git
// first on PATH refuses repo-wide subcommands (Policy.GitDenied, default
// DefaultRepoWideGit) with a message naming the lease and who may run them
// (exit 3), and runs the real git for everything else with
// GIT_OPTIONAL_LOCKS=0. The real git called by absolute path still cannot
// write the git dir of a shared workspace: Landlock refuses it.
//
// # Network
//
// Landlock judges TCP connect and bind by port only, and only in connect(2)
// and bind(2); the filter and the supervisor do the rest (net_linux.go):
//
//   - socket() and socketpair() make only TCP, Unix stream and seqpacket
//     and netlink route sockets (decided in the filter). UDP, raw, MPTCP,
//     SCTP, Unix datagram, packet and vsock sockets are refused (EACCES,
//     audited on boundary "net"), so an address passed to sendto/sendmsg
//     reaches nobody; Policy.AllowAnyConnect allows UDP. Names resolve
//     through the egress proxy: over CONNECT, or, for a client that
//     resolves before connecting, by DNS over TCP to port 53, which is
//     captured (below) and answered by the proxy (the agent's
//     RES_OPTIONS=use-vc makes glibc's resolver ask over TCP). With
//     capture on, a UDP socket() is answered with a socket of the sealed
//     network (sealednet_linux.go): a network namespace of its own where
//     port 53 of every address is a relay to the proxy's DNS over TCP
//     and nothing else is reachable, so Go's and musl's resolvers work
//     and no datagram leaves (TestSealedUDP). The agent owns that user
//     namespace (same uid) and can enter it, but it maps no uid: entering
//     gives power over the sealed network alone, from where nothing of
//     the machine is reached (TestSealedUDPEscape, TestSealedUDPFlood,
//     TestSealedUDPDup2Race, TestSealedUDPAfterLoss); signals to the
//     supervisor and queries the proxy leaves unanswered hold nothing up
//     (TestSealedUDPSignals, TestSealedUDPSettlesWithQueriesPending).
//   - A send with MSG_FASTOPEN and setsockopt TCP_FASTOPEN_CONNECT get
//     EOPNOTSUPP (what a kernel with client Fast Open off answers, so
//     clients fall back to connect) and are audited: TCP Fast Open
//     connects inside the send, where no connect check runs.
//   - connect() always traps and the supervisor performs it: it copies the
//     address once, judges the copy and connects its own duplicate of the
//     socket (pidfd_getfd) to it, in a goroutine of the Process so that a
//     slow connect stalls no other call. TCP goes to a Policy.ConnectPorts
//     port on the loopback, or anywhere with AllowAnyConnect. A Unix
//     socket path is opened O_PATH (relative to the task's cwd), must be
//     the socket file a Policy.UnixSockets path names (device and inode),
//     and is connected through /proc/self/fd/N of that descriptor; abstract
//     names are refused. Rewriting the address, dup2 onto the descriptor
//     or swapping a symlink after the check reaches nothing. The filter is
//     installed with WAIT_KILLABLE_RECV, so a signal cannot make the kernel
//     restart a connect the supervisor already made.
//   - Transparent capture (Policy.Capture, the egress proxy's address): a
//     TCP connect not allowed as it is, to any address but the loopback's
//     or to port 53 anywhere, is connected to the proxy instead. The
//     supervisor connects its duplicate of the agent's socket there (a
//     v4-mapped address for an IPv6 socket, its v6-only option cleared),
//     waits for a non-blocking connect to complete, writes
//     CapturePreamble naming the address it copied, and answers the
//     connect as done: the agent's first byte follows the preamble, and
//     the proxy judges the stream by its TLS server name or HTTP Host
//     (DNS for port 53) and dials that name, never the address. Tools
//     that ignore HTTPS_PROXY (Node 20's fetch, static binaries, raw
//     sockets) reach allowed hosts this way; the rest is refused by the
//     proxy and audited there. The loopback's other ports stay refused
//     here (TestTCPConnectCaptured, TestTCPConnectCaptureAddressRace).
//   - bind() and listen() always trap. The agent shares its network
//     namespace with the sidecar (in a pod, with every container): a port
//     or an abstract Unix name it holds is what the sidecar's clients (the
//     agent wrapper asking for the lease, a metrics scraper) reach once the
//     sidecar is gone, and the restarted sidecar then fails with "address
//     already in use". So an IP bind is judged on the supervisor's copy and
//     performed there: port 0 (the kernel chooses from ip_local_port_range:
//     test servers) is allowed, a fixed port only when Policy.BindPorts
//     lists it (a dev server's, --allow-bind), and never a reserved port
//     (Policy.ReservedPorts and ConnectPorts: the sidecar's admin and
//     fence ports), lease held or not; refusals are EACCES (what Landlock
//     answers) audited on boundary "net". listen() is performed on the
//     supervisor's duplicate after the port is judged (an unbound socket is
//     bound to a kernel-chosen port first), so a reserved port is refused
//     however the socket got it — a kernel-chosen one when the sidecar's
//     ports lie in the ephemeral range, or a bind that raced its check.
//     An abstract Unix name is refused (an autobind is allowed). A
//     pathname Unix bind continues to Landlock while the lease holds (its
//     MAKE_SOCK right judges the socket file, its BIND_TCP right refuses a
//     TCP socket and port swapped in meanwhile); after a loss it is
//     refused (boundary "file"). With Landlock ABI < 4 the supervisor's
//     checks stand alone and the listen check is what keeps a raced bind
//     off a reserved port. Left open: a TCP socket bound (not listening) to
//     a kernel-chosen port that is reserved blocks the restarted sidecar's
//     bind (keep the sidecar's ports out of ip_local_port_range, as the
//     example pod does); UDP (AllowAnyConnect only) is judged at bind only.
//
// # Other processes of the user
//
// The agent runs as the supervisor's uid. Landlock keeps ptrace, signals
// (ABI >= 6) and abstract Unix sockets within the attempt; prlimit64,
// setpriority, sched_setparam, sched_setscheduler, sched_setattr,
// sched_setaffinity and ioprio_set are not ptrace-checked, so they trap
// when they name another process (proc_linux.go): allowed on a process of
// the attempt, refused (EPERM, audited) on any other — the supervisor,
// whose RLIMIT_NOFILE or RLIMIT_CPU the agent could otherwise lower, the
// sealed network's helper — and on a process group or every process of
// the user (TestCallsOnOtherProcessesConfined).
//
// # System V IPC and keyrings
//
// Shared memory segments, message queues and semaphore sets live outside
// every file system, so Landlock does not see them; as the same user the
// agent could attach another process's segment and write into its memory.
// The supervisor makes shmget, msgget and semget itself and records what
// it created; every other call on an object (shmat, msgsnd, semop, the
// *ctl calls but their read-only queries) continues only for a recorded id
// and is refused otherwise (ipc_linux.go, TestSysVIPCConfined). What the
// attempt made and did not remove is removed once it settled
// (TestSysVIPCRemovedAtSettle).
//
// POSIX message queues live in the IPC namespace's mqueue file system,
// reached by name through mq_open and mq_unlink; no Landlock rule names
// it. Landlock refuses the open of a queue (its walk from an internal
// mount ends unmatched) but only in dentry_open, after mq_open made the
// queue: the agent got EACCES and a queue that outlived the run, and
// mq_unlink and the calls on a descriptor went through. The supervisor
// now makes mq_open itself from copies of the name and attributes: a
// create O_EXCL, recorded by inode (it keeps a descriptor of each queue)
// and handed over with SECCOMP_IOCTL_NOTIF_ADDFD; an existing queue only
// when recorded, whatever the flags. mq_unlink removes only a recorded
// queue still under its name. mq_timedsend, mq_timedreceive and
// mq_getsetattr setting flags are made by the supervisor on its duplicate
// of the descriptor (pidfd_getfd) for a recorded queue only, with copies
// of the message, timeout and attributes, so a dup2 onto the number after
// the check reaches nothing; a blocking one waits in a goroutine of the
// Process in slices, and a send stops at the loss. After the loss nothing
// is created, opened for writing, unlinked, sent or set; receiving from
// the attempt's own queue goes on. Every refusal is answered before any
// effect and audited (boundary "file", reason not-allowed or lease-lost).
// Queues the attempt left are removed once it settled (mq_linux.go,
// TestPosixMQConfined, TestPosixMQSendDup2Race,
// TestPosixMQBlockedSendStopsAtLoss). Where the mqueue file system is
// mounted (/dev/mqueue), a queue is a file to Landlock: opening it for
// writing, creating and unlinking are refused outside the lease, and a
// read-only descriptor opened there meets the supervisor's checks above
// (TestPosixMQThroughMount).
//
// The kernel keyrings are shared by every process of the user in the same
// way (the user keyring: tokens, Kerberos tickets), so keyctl, add_key and
// request_key are refused (EPERM, audited; keys_linux.go,
// TestKeyringsRefused), as container runtimes' default profiles do.
//
// # Starting a guarded process
//
// Go cannot run code between fork and exec, so the child is this binary
// again (/proc/self/exe) marked by an environment variable; Init, called
// first in main, turns it into the guarded child:
//
//	supervisor (Start)                      guarded child (Init)
//	    | socketpair(SEQPACKET), start /proc/self/exe (own session)
//	    | -- setup (rules, argv, env) ------> | LockOSThread, no_new_privs,
//	    |                                     | landlock_restrict_self,
//	    |                                     | seccomp(NEW_LISTENER)
//	    | <------ "ok" + listener (SCM_RIGHTS)| closes its listener
//	    | -- "go" ---------------------------> | execve(command)
//	    | <-- EOF (close-on-exec) ------------ | or "exec: ..." on failure
//	    | poll listener: RECV, Fence(), SEND CONTINUE | EACCES (+ audit)
//
// Landlock, no_new_privs and the filter apply to the thread that execs and
// are inherited by everything the command starts; nothing can remove them.
//
// # Settling
//
// The supervisor process is a child subreaper, so processes that
// double-fork or leave the process group are re-parented to it rather than
// to init. An attempt's tree is the command's descendants plus those
// adopted orphans (recognised by carrying the attempt's seccomp filter).
// One supervisor may run several attempts and adopts the orphans of all of
// them, so an orphan is the attempt's whose session it is in: each
// attempt's command leads a session of its own, which no process of
// another session can join a group of (TestAttemptCannotJoinAnotherAttemptsGroup),
// and setsid is trapped so the supervisor records each new session as the
// caller's attempt's before the call runs
// (TestCancelSparesAnotherAttemptsSessionOrphan).
// Canceling Start's context sends SIGTERM to the process group and, after
// Policy.KillGrace, SIGKILL to every process of the tree until none is
// left; adopted zombies are reaped. Wait returns — and Settled closes — only
// once the command was reaped, no process of the tree is alive, and the
// seccomp listener hung up, which the kernel does only when no task holds
// the filter any more: every process of the attempt is gone. The lead
// releases the lease after that.
//
// # Threat model
//
// The agent is an unprivileged, possibly careless or adversarial program of
// the same user. Covered: writes (create, overwrite, truncate, rename,
// link, unlink, mkdir, mknod, symlink creation) outside the lease, however
// the path is spelled; writes through inherited read-only descriptors
// re-opened via /proc/self/fd; static binaries; reading hidden credentials;
// TCP connects to upstream Postgres, git or NATS ports; new write-opens and
// namespace changes after the lease is lost, core dumps included (the
// command's hard core limit is 0: the kernel writes a core where Landlock
// lets it, TestNoCoreDumpAfterLoss) and a write-open let through while the
// lease held that a file lease (F_SETLEASE, refused) would hold in the
// kernel past the loss (TestOpenNotStretchedPastLoss); signalling the
// sidecar;
// terminal input injection (TestTerminalInjectionRefused); chattr and the
// other inode ioctls, also through a descriptor number switched with dup2
// (TestSetFlagsConfined, TestSetFlagsDup2Race); chmod, chown, utimes and xattrs
// outside the lease, also through a symlink swapped under the call
// (TestMetadataConfined, TestMetadataSymlinkRace), and file_setattr
// (TestFileSetattrConfined). After a loss /dev/null,
// the terminal, pipes and the temp dir keep working while the lease's paths,
// also through a symlink or hard link in the temp dir, stay refused
// (TestLostLeaseHarmlessWritesGoOn); a writable path or claim through a
// symlink, also one swapped in after the policy was resolved
// (TestWritableThroughSymlinkRefused, TestWritableRuleChecksTheDescriptor).
// Network (see Network): TCP connects only to the loopback's allowed ports,
// judged on the supervisor's copy of the address (TestTCPConnectLimited,
// TestTCPConnectAllowedLoopback, TestTCPConnectAddressRace); TCP Fast Open
// (TestTCPFastOpenRefused); Unix-socket connects only to listed sockets
// (TestUnixConnectLimited, TestUnixConnectSymlinkRace); UDP and every other
// datagram or raw socket (TestDatagramSocketsRefused); binding a Unix socket
// file after the lease is lost (TestBindAfterLoss); binding or listening on
// the sidecar's ports after it is gone, on any address, TCP or UDP, lease
// held or lost (TestAgentCannotListenOnSidecarPorts), also with a Unix bind
// whose descriptor and address are swapped for TCP and the sidecar's port
// under the call (TestBindRaceCannotTakeSidecarPort; with Landlock ABI < 4
// such a bind reaches the port but cannot listen on it,
// TestBindWithoutLandlockNet); fixed ports not
// allowed, while kernel-chosen ones work
// (TestAgentListensOnEphemeralAndAllowedPorts); abstract Unix names
// (TestAbstractUnixBindRefused). System V IPC objects
// of other processes (TestSysVIPCConfined); POSIX message queues of other
// processes, by name or through an inherited descriptor, also swapped in
// with dup2 under a send, and any queue made, unlinked, sent to or set
// after the loss, with no queue left behind by the run, also through a
// mounted mqueue file system (TestPosixMQConfined, TestPosixMQSendDup2Race,
// TestPosixMQBlockedSendStopsAtLoss, TestPosixMQThroughMount); the kernel keyrings
// (TestKeyringsRefused).
//
// Not covered (documented gaps):
//   - A descriptor opened for writing while the lease was held stays
//     writable after it is lost: write(2), mmap and friends on it are not
//     trapped (trapping every write would cost a round trip per write).
//   - A captured socket is connected to the egress proxy: getpeername
//     answers the address the agent chose (peername_linux.go) for the
//     last 4,096 captures, the proxy's for older ones; getsockname
//     answers the loopback end of the connection to the proxy. UDP but
//     DNS (QUIC, a resolver asking another port) reaches nobody; without
//     a user namespace for the sealed network UDP stays refused.
//   - The supervisor makes the agent's connects: a Unix-socket server sees
//     the supervisor's credentials (SO_PEERCRED), not the agent's. A TCP
//     connect still pending when the attempt ends is shut down; a connect
//     blocked on the full backlog of a listed Unix socket holds settling
//     until that server accepts or closes. A trapped call waits killable:
//     a handled signal (SIGALRM to cut a connect short) is delivered only
//     once the supervisor answered; a fatal signal ends the wait at once.
//   - Sockets the agent did not make (inherited, or received over a listed
//     Unix socket) are not judged again: what they send goes where they
//     may. Netlink route sockets are allowed (libc's getifaddrs).
//   - Emulated calls run with the supervisor's credentials, which are the
//     agent's (same user; no_new_privs keeps them so). A supervisor with
//     more privilege than its agent would lend it to those calls.
//   - After a loss: a FIFO without a reader answers ENXIO instead of
//     blocking; /dev/tty opens only when it is the supervisor's terminal
//     too; an absolute symlink inside the temp dir is not followed for a
//     write; link, symlink, truncate, mknod and metadata calls stay
//     refused even in the temp dir.
//   - Terminals: /dev/pts is writable (the agent's own pty and the ptys
//     it makes, e.g. node-pty, script, tmux), and readable like every
//     other path, so the agent can also write to, change the modes of
//     (stty) and read the input typed into another terminal of the same
//     user (checked on Linux 6.18). TIOCSTI and TIOCLINUX stay refused;
//     what a terminal emulator answers to escape sequences written to it
//     (answerback) reaches that terminal's input and is not judged.
//   - Hidden paths: names in their directories stay listable, and a
//     directory created later next to a hidden path is not readable.
//   - Processes running as another user, or with capabilities, are out of
//     scope; so is a kernel without Landlock (Start refuses to run unless
//     Policy.AllowUnguarded, which logs loudly).
//   - Denials Landlock makes while the lease holds are not fsguard audit
//     events; with ABI >= 7 the kernel's audit log records them.
//   - Several attempts in one supervisor process share the subreaper: an
//     orphan that double-forked before it was seen may be attributed to
//     every attempt's tree (fenceline runs one attempt per process).
//   - The git shim does not expand git aliases; the guard still applies.
//   - POSIX message queues: mq_notify registering on the agent's own queue
//     is checked on a duplicate of the descriptor and then continues (the
//     registration belongs to the calling task): a second thread that
//     dup2s another queue's descriptor onto the number in between
//     (inherited, or opened read-only through a mounted /dev/mqueue)
//     registers there; no message is written, the owner's own mq_notify
//     gets EBUSY. Queues the supervisor makes count against its
//     RLIMIT_MSGQUEUE, not the agent's. A queue another process unlinks
//     and makes again under a name the instant the supervisor removes the
//     agent's own could be removed in its place.
//   - System V objects the attempt made stay usable to it after the loss
//     (they are its own; msgsnd and shmat are not fenced).
//
// Containment after the run. The guard confines an attempt while it runs;
// what it leaves in a writable git dir (hooks, core.fsmonitor, filter and
// diff drivers, includes ...) would run later, unconfined, in whoever's
// git reads that dir. Three rules keep an attempt's effects in its
// workspace after it ends: fenceline runs every git command of its own
// through internal/gitsafe (no hook, and no program a repository's
// configuration names, ever runs); an exclusive attempt in a shard writes
// only its shard's own repository, which borrows the checkout's objects
// read-only and whose git dir cleaning rewrites (package shard); and an
// exclusive run without a pool gets the checkout's config files and hooks
// restored at settle, with what was undone reported. What an attempt does
// leave behind is data: its commits and files, kept as refs in the
// checkout (fetched, so every object is hashed), and its pushes, judged
// by the git fence from verified objects and again by the pre-receive
// hook against the signed claim.
//
// # Cost
//
// Landlock adds little per open. Each trapped write-class call costs one
// seccomp round trip to the supervisor (BenchmarkWriteOpen,
// BenchmarkCreateFiles; with SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP where the
// kernel has it); reads, writes to open descriptors and read-only opens
// cost nothing extra. A connect costs more than a plain loopback connect
// (the supervisor copies the address, duplicates the socket, connects it
// from a goroutine of its own and answers; BenchmarkConnect); a captured
// connect adds the preamble's write (BenchmarkConnectCaptured). socket(), sends and
// setsockopt are decided in the filter.
// A metadata call or inode ioctl costs that round trip plus the
// supervisor's resolution and the call itself.
// scripts/bench-fsguard.sh measures it side by side.
//
// # Why not go-landlock
//
// The Landlock maintainers' Go library (github.com/landlock-lsm/go-landlock,
// v0.11.2 weighed) covers every right, scope and logging flag the guard
// asks for, but its rules are paths it opens itself by name: there is no
// way to check that what it opened is the real path the supervisor
// resolved, so a symlink swapped in along a writable path between the
// check and the open would grant its target. The guard adds each rule on
// an O_PATH descriptor it has checked against the path (addWritableRule).
// The library's descriptor-level layer (its syscall package) is
// documented as unstable and liable to disappear; golang.org/x/sys/unix
// already defines every constant, so what remains here is three structs
// and three system calls (landlock_linux.go).
package fsguard
