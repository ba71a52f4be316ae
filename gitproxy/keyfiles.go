package gitproxy

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// SidecarKeyFile is where "fenceline hook install" leaves the sidecars'
// copy of repo's hook secret on this machine, and where "fenceline run"
// and "fenceline sidecar" look for it: inside fenceline's state dir
// stateDir (the CLI passes the one it read from the environment), which
// the file guard hides from agents.
func SidecarKeyFile(stateDir, repo string) string {
	return filepath.Join(stateDir, "git-hook", url.PathEscape(repo)+".key")
}

// WriteSidecarKey writes the sidecars' copy of a hook secret to path (hex,
// mode 0600, its directory made 0700 when missing), replacing one for the
// same repository; a file already holding key only has its mode fixed.
func WriteSidecarKey(path string, key []byte) error {
	if old, err := ReadKeyFile(path); err == nil && string(old) == string(key) {
		if err := os.Chmod(path, 0o600); err != nil {
			return fmt.Errorf("write sidecar secret: %w", err)
		}
		return nil
	}
	tmp := path + ".tmp"
	os.Remove(tmp)
	if err := WriteKeyFile(tmp, key); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write sidecar secret: %w", err)
	}
	return nil
}

// FindSidecarKey reads repo's hook secret from SidecarKeyFile(stateDir,
// repo) when that file exists. It returns a nil key and no file when there is none
// (or repo is ""), and the file with the error when it cannot be read.
func FindSidecarKey(stateDir, repo string) (key []byte, file string, err error) {
	if repo == "" {
		return nil, "", nil
	}
	file = SidecarKeyFile(stateDir, repo)
	if _, err := os.Stat(file); err != nil {
		return nil, "", nil
	}
	if key, err = ReadKeyFile(file); err != nil {
		return nil, file, err
	}
	return key, file, nil
}

// InstallHookForSidecars is InstallHook followed by WriteSidecarKey: the
// hook and its secret in the server's repository, and the sidecars' copy
// of the secret in sidecarFile (SidecarKeyFile's, usually).
func InstallHookForSidecars(ctx context.Context, in HookInstall, sidecarFile string) (*Installed, string, error) {
	if sidecarFile == "" {
		return nil, "", errors.New("install hook: no file for the sidecars' copy of its secret")
	}
	res, err := InstallHook(ctx, in)
	if err != nil {
		return nil, "", err
	}
	if err := WriteSidecarKey(sidecarFile, res.Key); err != nil {
		return nil, "", err
	}
	return res, sidecarFile, nil
}

// HookAuditTimeout bounds RecordRefusal: a push waits for it, and the
// refusal stands either way.
const HookAuditTimeout = 3 * time.Second

// AuditEvent is the audit event of this refusal of the pre-receive hook
// on repo at t. The lease, owner and fence are as the push claimed them:
// a refused fence may be forged.
func (e *HookError) AuditEvent(repo string, t time.Time) lease.AuditEvent {
	fence, _ := strconv.ParseUint(e.Fence, 10, 64)
	return lease.AuditEvent{
		Time: t.UTC(), Type: lease.EventDenied, Boundary: lease.BoundaryGit,
		Repo: repo, LeaseID: e.Lease, Owner: lease.ParseOwner(e.Owner), Fence: fence,
		Reason: e.Reason, Message: "pre-receive hook: " + e.Msg,
	}
}

// RecordRefusal writes a refusal of the pre-receive hook on repo to aud
// (*leasebus.Auditor writes the bus's audit stream, boundary git),
// waiting at most HookAuditTimeout for it to be acknowledged; its error
// is aud's.
func RecordRefusal(ctx context.Context, aud lease.Auditor, repo string, he *HookError) error {
	ctx, cancel := context.WithTimeout(ctx, HookAuditTimeout)
	defer cancel()
	return aud.Record(ctx, he.AuditEvent(repo, time.Now()))
}
