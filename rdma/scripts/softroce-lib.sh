# shellcheck shell=bash
# Shared by softroce-test.sh (one soft-RoCE VM) and softroce-cluster.sh
# (several): the Debian kernel, fetched and unpacked but never installed, and
# the parts of a hand-made busybox initramfs that load soft-RoCE (rdma_rxe)
# and run verbs programs. Sourced, not run. The caller defines `say` and sets
# `work` (the cache folder, e.g. target/softroce).
#
# Why a hand-made initramfs and TCG: see ../shared/reference/softroce-vm.md
# (the development kernels have no RDMA and no module loading, and KVM cannot
# run a stock kernel on these hosts).

softroce_libdir=/usr/lib/x86_64-linux-gnu

# softroce_kernel: sets kver and kdir, the unpacked kernel package (its
# vmlinuz in $kdir/boot, its modules with a depmod index), fetching it with
# `apt-get download` into $work the first time.
softroce_kernel() {
    local kpkg
    kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    [ -n "$kpkg" ] || { say "no linux-image-amd64 in the apt lists (run apt-get update)"; return 1; }
    kver=${kpkg#linux-image-}
    kdir=$work/kernel-$kver
    if [ ! -f "$kdir/boot/vmlinuz-$kver" ]; then
        say "fetching $kpkg"
        rm -rf "$kdir" "$work"/dl; mkdir -p "$work/dl" "$kdir"
        (cd "$work/dl" && apt-get download -o APT::Sandbox::User=root "$kpkg" >/dev/null)
        dpkg-deb -x "$work"/dl/*.deb "$kdir"
        depmod -b "$kdir" "$kver"
        rm -rf "$work/dl"
    fi
}

# softroce_copy_with_libs FILE...: copies each FILE to the same path under
# $root, with every library `ldd` names for it.
softroce_copy_with_libs() {
    local f
    for f in "$@"; do
        mkdir -p "$root$(dirname "$f")"
        cp -L "$f" "$root$f"
        ldd "$f" 2>/dev/null | grep -o '/[^ ]*' | while read -r lib; do
            mkdir -p "$root$(dirname "$lib")"
            [ -e "$root$lib" ] || cp -L "$lib" "$root$lib"
        done
    done
}

# softroce_initramfs_base APPLET... -- FILE...: a fresh $root with busybox
# (a link per APPLET), the verbs user space (libibverbs and librdmacm, which
# sideway dlopens, the rxe provider, the `rdma` tool) and each FILE, all with
# their libraries, and the kernel modules soft-RoCE needs, listed in load
# order in $root/modules.order (paths inside $root; .ko, .ko.xz or .ko.zst).
softroce_initramfs_base() {
    local applets=() app
    while [ $# -gt 0 ] && [ "$1" != -- ]; do applets+=("$1"); shift; done
    [ $# -eq 0 ] || shift
    rm -rf "$root"
    mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,mnt/host,etc/libibverbs.d,lib/modules,usr/lib/x86_64-linux-gnu/libibverbs}
    cp /bin/busybox "$root/bin/busybox"
    for app in "${applets[@]}"; do
        [ "$app" = busybox ] || ln -sf busybox "$root/bin/$app"
    done
    local libdir=$softroce_libdir rdma_tool l
    rdma_tool=$(command -v rdma || echo /sbin/rdma)
    # libibverbs and librdmacm are loaded at run time by sideway (dlopen):
    # copy them and the rxe provider by name, with their own libraries.
    softroce_copy_with_libs "$rdma_tool" "$@" \
        "$(readlink -f $libdir/libibverbs.so.1)" "$(readlink -f $libdir/librdmacm.so.1)" \
        $libdir/libibverbs/librxe-rdmav*.so
    for l in libibverbs.so.1 librdmacm.so.1; do
        cp -P "$libdir/$l" "$root$libdir/$l"
    done
    cp /etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/"
    mkdir -p "$root/lib64"; [ -e "$root/lib64/ld-linux-x86-64.so.2" ] || cp -L /lib64/ld-linux-x86-64.so.2 "$root/lib64/"
    # Modules in dependency order; crc32_generic first-class: rxe needs it and
    # nothing loads it (without it `rdma link add` fails with ENOENT).
    local mods="" order="" m f rel
    for m in virtio_pci virtio_net 9pnet_virtio 9p crc32_generic rdma_rxe rdma_ucm; do
        mods="$mods $(modprobe -d "$kdir" -S "$kver" --show-depends "$m" | awk '$1=="insmod"{print $2}')"
    done
    for f in $mods; do
        case " $order " in *" $f "*) ;; *) order="$order $f" ;; esac
    done
    : > "$root/modules.order"
    for f in $order; do
        rel=${f#"$kdir"}
        mkdir -p "$root$(dirname "$rel")"
        cp "$f" "$root$rel"
        echo "$rel" >> "$root/modules.order"
    done
}

# The guest side of the module list above: sh code for an init script that
# loads every module of /modules.order.
# shellcheck disable=SC2016 # expanded in the guest
softroce_load_modules_sh='for m in $(cat /modules.order); do
    case "$m" in
        *.xz) xz -dc "$m" > /tmp/m.ko && insmod /tmp/m.ko ;;
        *.zst) zstd -dc "$m" > /tmp/m.ko && insmod /tmp/m.ko ;;
        *) insmod "$m" ;;
    esac || echo "softroce-vm: insmod $m failed"
done'

# softroce_pack OUT: $root as a gzipped newc cpio archive.
softroce_pack() {
    (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$1"
}
