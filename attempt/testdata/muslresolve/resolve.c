/* muslresolve NAME: a static musl program that looks NAME up with musl's
 * getaddrinfo (DNS over UDP only, as Alpine's tools resolve) and prints
 * the first IPv4 address, or "error: ..." and exits 1. The capture tests
 * build it with musl-gcc -static and run it under the file guard. */
#include <arpa/inet.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

int main(int argc, char **argv) {
	if (argc != 2) {
		fprintf(stderr, "usage: muslresolve NAME\n");
		return 2;
	}
	struct addrinfo hints, *res;
	memset(&hints, 0, sizeof hints);
	hints.ai_family = AF_INET;
	hints.ai_socktype = SOCK_STREAM;
	int rc = getaddrinfo(argv[1], "443", &hints, &res);
	if (rc != 0) {
		printf("error: %s\n", gai_strerror(rc));
		return 1;
	}
	char buf[INET_ADDRSTRLEN];
	struct sockaddr_in *sin = (struct sockaddr_in *)res->ai_addr;
	printf("%s\n", inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof buf));
	return 0;
}
