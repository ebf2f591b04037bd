//! Device health read from the agent's reports: what taints a device (keeps it out of
//! placement, shown to the operator) besides going missing.

use passage_model::{PciDetails, PciDevice};

const PASSTHROUGH_DRIVER: &str = "vfio-pci";

/// Why `now` should be tainted, given its previous report and whether it is attached to a
/// VM at rest: `used` by a VM with no job running. Only then must it be on vfio-pci: while
/// a job runs, the node binds and unbinds it (a destroy's `unbind` comes before its
/// `release`, and the agent reports its drivers right after), and a taint for that would
/// take a healthy device out of placement for good.
pub fn taint(
    attached_at_rest: bool,
    previous: Option<&PciDetails>,
    now: &PciDevice,
) -> Option<String> {
    let mut why = Vec::new();
    if let (Some(p), Some(n)) = (previous, now.details.as_ref()) {
        if let (Some(a), Some(b)) = (p.aer_fatal, n.aer_fatal)
            && b > a
        {
            why.push(format!("AER fatal errors rose from {a} to {b}"));
        }
        if let (Some(a), Some(b)) = (p.aer_nonfatal, n.aer_nonfatal)
            && b > a
        {
            why.push(format!("AER non-fatal errors rose from {a} to {b}"));
        }
    }
    if attached_at_rest && now.driver.as_deref() != Some(PASSTHROUGH_DRIVER) {
        why.push(format!(
            "bound to {} while attached to a VM (expected {PASSTHROUGH_DRIVER})",
            now.driver.as_deref().unwrap_or("no driver")
        ));
    }
    (!why.is_empty()).then(|| why.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(driver: Option<&str>, fatal: Option<u64>, nonfatal: Option<u64>) -> PciDevice {
        PciDevice {
            id: "/devices/pci0000:00/0000:00:01.0/0000:01:00.0"
                .parse()
                .unwrap(),
            vendor: "10de".parse().unwrap(),
            device: "2330".parse().unwrap(),
            subvendor: "10de".parse().unwrap(),
            subsystem: "16c1".parse().unwrap(),
            revision: "a1".parse().unwrap(),
            class: "030200".parse().unwrap(),
            driver: driver.map(String::from),
            numa_node: None,
            iommu_group: None,
            details: Some(PciDetails {
                aer_fatal: fatal,
                aer_nonfatal: nonfatal,
                ..PciDetails::default()
            }),
        }
    }

    #[test]
    fn rising_aer_counters_taint() {
        let before = dev(Some("nvidia"), Some(0), Some(2));
        let p = before.details.as_ref();
        assert_eq!(
            taint(false, p, &dev(Some("nvidia"), Some(0), Some(2))),
            None
        );
        let t = taint(false, p, &dev(Some("nvidia"), Some(1), Some(2))).unwrap();
        assert!(t.contains("fatal errors rose from 0 to 1"), "{t}");
        let t = taint(false, p, &dev(Some("nvidia"), Some(0), Some(5))).unwrap();
        assert!(t.contains("non-fatal errors rose from 2 to 5"), "{t}");
        // No earlier report, or counters that went down (a reboot): nothing to compare.
        assert_eq!(
            taint(false, None, &dev(Some("nvidia"), Some(9), Some(9))),
            None
        );
        assert_eq!(
            taint(false, p, &dev(Some("nvidia"), Some(0), Some(0))),
            None
        );
    }

    #[test]
    fn a_device_attached_at_rest_must_stay_on_vfio() {
        assert_eq!(taint(true, None, &dev(Some("vfio-pci"), None, None)), None);
        let t = taint(true, None, &dev(Some("nvidia"), None, None)).unwrap();
        assert!(t.contains("bound to nvidia while attached"), "{t}");
        assert!(
            taint(true, None, &dev(None, None, None))
                .unwrap()
                .contains("no driver")
        );
        assert_eq!(taint(false, None, &dev(Some("nvidia"), None, None)), None);
    }
}
