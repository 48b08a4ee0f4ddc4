#!/bin/sh
# Run by the runtime stages of examples/k8s/Dockerfile (as root, once), after
# /opt/ptrain (programs + share/ptrain/runtime-packages) has been copied in.
#
# 1. Installs the packages of the libraries the programs load (the list that
#    examples/k8s/build-programs.sh wrote), Open MPI's mpirun and orted
#    (openmpi-bin) and OpenSSH: the MPIJob's launcher runs mpirun, which starts
#    orted on the workers through ssh. No recommended packages: no compilers.
# 2. Adds the user the programs run as, uid 1000 (the manifests' runAsUser),
#    and its sshd configuration for the MPIJob: sshd runs as this user on port
#    2222 with the key pair the MPI Operator mounts in ~/.ssh as host and user
#    key; StrictModes is off because the mounted files belong to root.
set -eu
export DEBIAN_FRONTEND=noninteractive
apt-get update
# The list is one package per line; word splitting is what is wanted.
# shellcheck disable=SC2046
apt-get install -y --no-install-recommends $(cat /opt/ptrain/share/ptrain/runtime-packages) \
  openmpi-bin openssh-client openssh-server
rm -rf /var/lib/apt/lists/*

# Ubuntu's images have a user 1000 (ubuntu); uid 1000 is ptrain in both variants.
if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi
useradd --uid 1000 --create-home --shell /bin/bash ptrain
mkdir -p /run/sshd
printf '%s\n' 'Port 2222' 'PidFile /home/ptrain/sshd.pid' 'HostKey /home/ptrain/.ssh/id_rsa' \
  'AuthorizedKeysFile /home/ptrain/.ssh/authorized_keys' 'StrictModes no' 'PasswordAuthentication no' \
  > /home/ptrain/.sshd_config
chown ptrain:ptrain /home/ptrain/.sshd_config
# ssh (run by mpirun) reaches the workers' sshd on 2222 and does not ask about host keys.
printf '%s\n' 'Host *' '    Port 2222' '    StrictHostKeyChecking no' '    UserKnownHostsFile /dev/null' \
  > /etc/ssh/ssh_config.d/ptrain.conf
