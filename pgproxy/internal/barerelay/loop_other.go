//go:build !linux

package main

import "errors"

func listenTCP(string) (int, error) { return -1, errors.New("-mode loop and coro need Linux (epoll)") }

func loopRelay(int, string, int) error { return errors.New("-mode loop needs Linux (epoll)") }

func coroRelay(int, string, int) error { return errors.New("-mode coro needs Linux (epoll)") }
