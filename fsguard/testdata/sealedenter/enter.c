/* sealedenter USERNS-FD NETNS-FD FILE HOST:PORT [CMD ARGS...]: an agent's
 * attempt to enter the sealed network's user and network namespaces
 * (descriptors it got with SIOCGSKNS and NS_GET_USERNS on a sealed UDP
 * socket), which setns(CLONE_NEWUSER) allows only to a single-threaded
 * process, hence C. It prints what entering gave, reads FILE (a file of
 * the agent's uid it may not read), connects over TCP to HOST:PORT (a
 * listener of this machine), then runs CMD inside with the capabilities
 * it holds there. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static const char *res(int ok) { return ok ? "ok" : strerror(errno); }

int main(int argc, char **argv) {
	if (argc < 5) {
		fprintf(stderr, "usage: sealedenter USERNS-FD NETNS-FD FILE HOST:PORT [CMD ARGS...]\n");
		return 2;
	}
	int ok = setns(atoi(argv[1]), CLONE_NEWUSER) == 0;
	printf("setns-user=%s\n", res(ok));
	ok = setns(atoi(argv[2]), CLONE_NEWNET) == 0;
	printf("setns-net=%s\n", res(ok));

	char buf[64] = {0};
	int fd = open(argv[3], O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		ssize_t n = read(fd, buf, sizeof buf - 1);
		printf("read=%s\n", n >= 0 ? buf : strerror(errno));
	} else {
		printf("read=%s\n", strerror(errno));
	}

	char host[64];
	snprintf(host, sizeof host, "%s", argv[4]);
	char *colon = strrchr(host, ':');
	*colon = 0;
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(colon + 1))};
	inet_pton(AF_INET, host, &sa.sin_addr);
	int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	ok = s >= 0 && connect(s, (struct sockaddr *)&sa, sizeof sa) == 0;
	printf("tcp=%s\n", res(ok));
	fflush(stdout);
	if (argc > 5) {
		/* Keep the namespace's capabilities across exec (ambient), as
		 * an attacker would: an exec recomputes them from the uid,
		 * which the namespace may not map. */
		struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3};
		struct __user_cap_data_struct d[2];
		syscall(SYS_capget, &h, d);
		d[0].inheritable = d[0].permitted;
		d[1].inheritable = d[1].permitted;
		syscall(SYS_capset, &h, d);
		for (int c = 0; c < 64; c++)
			prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, c, 0, 0);
		execv(argv[5], argv + 5);
		printf("exec=%s\n", strerror(errno));
	}
	return 0;
}
