/* The pod sandbox ("pause") process of kubedistill's local images: it holds a pod's namespaces
 * and does nothing else. It blocks until SIGTERM or SIGINT (then exits 0) and, as PID 1 of a pod
 * that shares its PID namespace, reaps every zombie child it inherits (SIGCHLD).
 * Built static by scripts/build-images.sh:  gcc -static -Os -s -o pause images/pause/pause.c
 * `pause -v` prints the version and exits. */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERSION "3.10"

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  int saved = errno;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
  errno = saved;
}

static void say(int fd, const char *msg) {
  ssize_t ignored = write(fd, msg, strlen(msg));
  (void)ignored;
}

static int handle(int sig, void (*fn)(int)) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = fn;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = sig == SIGCHLD ? SA_NOCLDSTOP | SA_RESTART : SA_RESTART;
  return sigaction(sig, &sa, NULL);
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    say(1, "pause.c " VERSION "\n");
    return 0;
  }
  if (getpid() != 1) {
    say(2, "pause: warning: not running as PID 1\n");
  }
  if (handle(SIGINT, on_stop) < 0 || handle(SIGTERM, on_stop) < 0 || handle(SIGCHLD, on_child) < 0) {
    say(2, "pause: error: sigaction failed\n");
    return 1;
  }
  for (;;) {
    pause();
  }
  say(2, "pause: error: infinite loop terminated\n");
  return 42;
}
