#!/bin/sh
# Builds the guest image the node agent's boot tests run: Debian 12 from Debian's
# packages only (mmdebstrap with the host's apt sources), the cloud kernel, extlinux on
# an MBR disk that boots both ways (extlinux for BIOS; systemd-boot from an EFI system
# partition for UEFI), and a boot script that reports on the serial console what the
# tests check:
#   PASSAGE-EDU-COUNT=N   the stand-in devices (QEMU edu, 1234:11e8) the guest sees
#   PASSAGE-BOOT-COUNT=N  a counter kept on the disk, one more on each boot
#   PASSAGE-FIRMWARE=F    uefi or bios, as the guest kernel found it
#   PASSAGE-LSPCI=…, PASSAGE-IVSHMEM=BDF NODE   the sized stand-ins' regions and nodes
# (the boot count comes last: a test that waits for it has the rest)
# and cloud-init (Debian's package, NoCloud) to apply a seed when one is attached: a
# vfat volume labelled cidata (the node agent's seed.rs). Without one, ds-identify finds
# no datasource and disables cloud-init for the boot, which then costs nothing.
# Usage: test_image.sh OUT.qcow2 WORKDIR   (as root: it mounts a loop device)
# xtask keys its cache on a hash of this file: change it and the image is rebuilt.
set -eu
out=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
root=$work/root
mnt=$work/mnt

# The host's own sources (deb822 or one-line) on stdin: only Debian's registries.
# A blank line after each file keeps deb822 stanzas of two files apart.
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
  [ -f "$f" ] && { grep -v '^#' "$f" || true; echo; }
done >"$work/sources"
mmdebstrap --variant=minbase --mode=root \
  --include=systemd-sysv,udev,linux-image-cloud-amd64,kmod,systemd-boot-efi \
  --include=cloud-init,openssh-server,sudo,ifupdown,net-tools,iproute2,resolvconf,pciutils,curl \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --aptopt='Acquire::Retries "3"' \
  bookworm "$root" - <"$work/sources"

cat >"$root/usr/local/sbin/passage-report" <<'EOF'
#!/bin/sh
n=0
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat "$d/vendor")" = 0x1234 ] && [ "$(cat "$d/device")" = 0x11e8 ]; then
    n=$((n + 1))
  fi
done
c=$(cat /var/lib/passage-boot-count 2>/dev/null || echo 0)
c=$((c + 1))
echo "$c" >/var/lib/passage-boot-count
sync
if [ -d /sys/firmware/efi ]; then fw=uefi; else fw=bios; fi
# Sized stand-ins (ivshmem-plain, 1af4:1110): where the guest's firmware put their
# BARs, and the NUMA node each sits on, as the guest's own lspci and sysfs say.
lspci -v -d 1af4:1110 2>/dev/null | sed -n 's/^\t\(Memory at .*\)/PASSAGE-LSPCI=\1/p' >/dev/ttyS0
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat "$d/vendor")" = 0x1af4 ] && [ "$(cat "$d/device")" = 0x1110 ]; then
    echo "PASSAGE-IVSHMEM=${d##*/} $(cat "$d/numa_node")" >/dev/ttyS0
  fi
done
echo "PASSAGE-EDU-COUNT=$n" >/dev/ttyS0
echo "PASSAGE-FIRMWARE=$fw" >/dev/ttyS0
echo "PASSAGE-BOOT-COUNT=$c" >/dev/ttyS0
EOF
chmod 755 "$root/usr/local/sbin/passage-report"
cat >"$root/etc/systemd/system/passage-report.service" <<'EOF'
[Unit]
Description=Report stand-in devices and the boot counter on the serial console
After=local-fs.target
[Service]
Type=oneshot
ExecStart=/usr/local/sbin/passage-report
[Install]
WantedBy=multi-user.target
EOF
ln -sf /etc/systemd/system/passage-report.service \
  "$root/etc/systemd/system/multi-user.target.wants/passage-report.service"
echo passage-test >"$root/etc/hostname"
# cloud-init: only the datasources a Passage node gives (NoCloud), so ds-identify
# checks one label and nothing else. ConfigDrive is listed too because ds-identify
# takes a list of one (with or without None) as found without looking, which would
# run cloud-init on every boot, seed or not.
cat >"$root/etc/cloud/cloud.cfg.d/90_dpkg.cfg" <<'EOF'
datasource_list: [ NoCloud, ConfigDrive, None ]
EOF
# What a first boot under emulation spends most on, or fails at, in this image: RSA and
# DSA host keys (14 s of the init stage; Ed25519 and ECDSA take a second), the locale
# (Debian's default en_US.UTF-8 is not generated here, so update-locale fails; C.UTF-8
# is built into glibc) and grub-dpkg (the disk boots with extlinux).
cat >"$root/etc/cloud/cloud.cfg.d/91_passage-test.cfg" <<'EOF'
ssh_genkeytypes: [ ed25519, ecdsa ]
locale: C.UTF-8
grub_dpkg:
  enabled: false
EOF
# Every VM made from the image would share these: cloud-init makes new ones at first
# boot (ssh_deletekeys), and without a seed sshd has no network to serve anyway.
rm -f "$root"/etc/ssh/ssh_host_*
mkdir -p "$root/etc/systemd/system/ssh.service.d"
cat >"$root/etc/systemd/system/ssh.service.d/passage-host-keys.conf" <<'EOF'
[Unit]
ConditionPathExistsGlob=/etc/ssh/ssh_host_*_key
EOF
echo 'LABEL=root / ext4 defaults 0 1' >"$root/etc/fstab"
# An empty root password on the console only: a test image, never a product image.
chroot "$root" passwd -d root >/dev/null
# What a test boot does not need, and slows a boot under emulation.
for u in systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer \
  e2scrub_all.timer e2scrub_reap.service fstrim.timer; do
  ln -sf /dev/null "$root/etc/systemd/system/$u"
done
kernel=$(cd "$root/boot" && ls vmlinuz-* | head -n1)
initrd=$(cd "$root/boot" && ls initrd.img-* | head -n1)
mkdir -p "$root/boot/extlinux"
cat >"$root/boot/extlinux/extlinux.conf" <<EOF
DEFAULT debian
TIMEOUT 1
PROMPT 0
LABEL debian
  LINUX /boot/$kernel
  INITRD /boot/$initrd
  APPEND root=LABEL=root rw console=ttyS0,115200 net.ifnames=0
EOF
rm -rf "$root/var/cache/apt/"* "$root/var/lib/apt/lists/"*

# The disk: an MBR with an EFI system partition (type ef) from 1 MiB, which UEFI
# firmware boots through systemd-boot, and the bootable ext4 root after it, which BIOS
# boots through the MBR code and extlinux. The root is last so that cloud-init can grow
# it into a larger disk. Each file system is made apart and written at its offset.
esp_mib=64
part_mib=1536
raw=$work/disk.raw
truncate -s $((1 + esp_mib + part_mib))M "$raw"
printf 'start=2048, size=%s, type=ef\nstart=%s, type=83, bootable\n' \
  $((esp_mib * 2048)) $(((1 + esp_mib) * 2048)) | sfdisk -q "$raw"
esp=$work/esp.raw
mkfs.vfat -C -n ESP "$esp" $((esp_mib * 1024)) >/dev/null
# Written with mtools: a container's kernel may have no vfat to mount.
mmd -i "$esp" ::/EFI ::/EFI/BOOT ::/loader ::/loader/entries
mcopy -i "$esp" "$root/usr/lib/systemd/boot/efi/systemd-bootx64.efi" ::/EFI/BOOT/BOOTX64.EFI
mcopy -i "$esp" "$root/boot/$kernel" ::/vmlinuz
mcopy -i "$esp" "$root/boot/$initrd" ::/initrd.img
printf 'default debian.conf\ntimeout 0\n' >"$work/loader.conf"
printf '%s\n' 'title Debian' 'linux /vmlinuz' 'initrd /initrd.img' \
  'options root=LABEL=root rw console=ttyS0,115200 net.ifnames=0' >"$work/debian.conf"
mcopy -i "$esp" "$work/loader.conf" ::/loader/loader.conf
mcopy -i "$esp" "$work/debian.conf" ::/loader/entries/debian.conf
dd if="$esp" of="$raw" bs=1M seek=1 conv=notrunc status=none
rm -f "$esp"
mkfs.ext4 -q -F -L root -d "$root" "$work/part.raw" ${part_mib}M
dd if="$work/part.raw" of="$raw" bs=1M seek=$((1 + esp_mib)) conv=notrunc status=none
rm -f "$work/part.raw"
mkdir -p "$mnt"
mount -o loop,offset=$(((1 + esp_mib) * 1048576)) "$raw" "$mnt"
extlinux --install "$mnt/boot/extlinux" >/dev/null 2>&1 || { umount "$mnt"; exit 1; }
umount "$mnt"
dd if=/usr/lib/EXTLINUX/mbr.bin of="$raw" bs=440 count=1 conv=notrunc status=none
qemu-img convert -c -f raw -O qcow2 "$raw" "$out.tmp"
mv "$out.tmp" "$out"
rm -rf "$work"
